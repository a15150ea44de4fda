"""The results CSV holds no spreadsheet formula (`csv_cells`): grid values and metric names are
an agent's words."""

from __future__ import annotations

import csv
import io
from types import SimpleNamespace

import pandas as pd

from prefect_gpu_budget.agents.door import Door
from prefect_gpu_budget.csv_cells import safe_cell, to_csv

HOSTILE = ["=1+2", "+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)", "\t=1", "plain"]


def _read(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


def test_every_text_cell_and_header_that_starts_a_formula_is_quoted_and_numbers_stay():
    frame = pd.DataFrame({"trial": range(len(HOSTILE)), "opt": HOSTILE, "=HYPERLINK(x)": -0.5})
    header, *rows = _read(to_csv(frame))
    assert header == ["trial", "opt", "'=HYPERLINK(x)"]
    assert [r[1] for r in rows] == ["'" + v if v != "plain" else v for v in HOSTILE]
    assert {r[2] for r in rows} == {"-0.5"}  # a number, not text: left as it is


def test_the_doors_results_csv_is_made_safe():
    rows = [{"trial": 0, "opt": "=cmd()", "loss": -1.0}]
    door = SimpleNamespace(results=lambda caller, run_id: rows)
    header, row = _read(Door.results_csv(door, None, "run"))
    assert header == ["trial", "opt", "loss"] and row == ["0", "'=cmd()", "-1.0"]


def test_a_file_is_written_the_same_way(tmp_path):
    to_csv(pd.DataFrame({"lr": ["@evil"]}), tmp_path / "trials.csv")
    assert _read((tmp_path / "trials.csv").read_text()) == [["lr"], ["'@evil"]]


def test_a_carriage_return_first_is_a_formula_too():
    assert safe_cell("\r=1") == "'\r=1" and safe_cell(-1) == -1 and safe_cell("1-2") == "1-2"
