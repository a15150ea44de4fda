"""The sandbox's copy of a job's metrics file to the launcher's (`SandboxedJob.sync_metrics`,
`copy_metrics`): real files, as the current user; the file of another user needs root."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from prefect_gpu_budget.sandbox import job as sandbox
from prefect_gpu_budget.sandbox.env import Redactor
from prefect_gpu_budget.sandbox.job import SandboxedJob, copy_metrics
from prefect_gpu_budget.sandbox.users import JobUser

NOBODY_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")


def _me() -> JobUser:
    return JobUser(name="me", uid=os.getuid(), gid=os.getgid(), switch=False)


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as out:
        out.write(data)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """(the job's metrics file, empty; the launcher's, not there yet)."""
    job = tmp_path / "job"
    job.mkdir()
    mine = job / "metrics.jsonl"
    mine.touch()
    return mine, tmp_path / "results" / "trial-0.jsonl"


@pytest.fixture
def job(files: tuple[Path, Path]) -> SandboxedJob:
    files[1].parent.mkdir()
    return SandboxedJob(
        user=_me(),
        workdir=files[0].parent,
        env={},
        redact=Redactor(()),
        metrics=files,
    )


def test_only_whole_lines_are_copied_until_the_end(files):
    mine, theirs = files
    theirs.parent.mkdir()
    _append(mine, b'{"step": 0}\n{"step": 1}\n{"ste')
    at = copy_metrics(mine, theirs, _me(), 0, final=False)
    assert at == 24
    assert theirs.read_bytes() == b'{"step": 0}\n{"step": 1}\n'
    assert copy_metrics(mine, theirs, _me(), at, final=False) == at  # still no newline
    assert theirs.read_bytes() == b'{"step": 0}\n{"step": 1}\n'
    _append(mine, b'p": 2}')
    at = copy_metrics(mine, theirs, _me(), at, final=True)
    assert at == mine.stat().st_size
    assert theirs.read_bytes() == mine.read_bytes()


def test_a_file_without_a_newline_is_copied_only_when_final(files):
    mine, theirs = files
    theirs.parent.mkdir()
    _append(mine, b'{"partial": true}')
    assert copy_metrics(mine, theirs, _me(), 0, final=False) == 0
    assert not theirs.exists()
    assert copy_metrics(mine, theirs, _me(), 0, final=True) == 17
    assert theirs.read_bytes() == b'{"partial": true}'


def test_an_empty_or_missing_file_copies_nothing(files):
    mine, theirs = files
    theirs.parent.mkdir()
    assert copy_metrics(mine, theirs, _me(), 0, final=True) == 0
    assert not theirs.exists()
    mine.unlink()
    assert copy_metrics(mine, theirs, _me(), 5, final=True) == 5
    assert not theirs.exists()


def test_sync_copies_each_byte_once(job, files):
    mine, theirs = files
    job.sync_metrics()
    assert job.copied == 0 and not theirs.exists()
    _append(mine, b'{"step": 0}\n')
    job.sync_metrics()
    job.sync_metrics()
    assert job.copied == 12
    assert theirs.read_bytes() == b'{"step": 0}\n'
    _append(mine, b'{"step": 1}\n{"step": 2}\n{"step"')
    job.sync_metrics()
    assert theirs.read_bytes() == b'{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    _append(mine, b': 3}\n{"summary": true}')
    job.sync_metrics()
    job.sync_metrics()
    assert theirs.read_bytes() == b'{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    job.finish()
    whole = b'{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"summary": true}'
    assert theirs.read_bytes() == whole
    assert job.copied == len(whole)
    assert not job.workdir.exists()


def test_the_launchers_file_keeps_what_it_had(job, files):
    """The copy appends: the launcher's file may hold lines already."""
    mine, theirs = files
    theirs.write_bytes(b'{"earlier": 1}\n')
    _append(mine, b'{"step": 0}\n')
    job.finish()
    assert theirs.read_bytes() == b'{"earlier": 1}\n{"step": 0}\n'


def test_sync_without_a_metrics_file_does_nothing(tmp_path):
    job = SandboxedJob(user=_me(), workdir=tmp_path / "w", env={}, redact=Redactor(()))
    job.sync_metrics()
    job.sync_metrics(final=True)
    assert job.copied == 0


def test_a_symlink_is_not_followed(files):
    mine, theirs = files
    theirs.parent.mkdir()
    elsewhere = mine.parent.parent / "secret.jsonl"
    elsewhere.write_bytes(b'{"secret": "worker-only"}\n')
    mine.unlink()
    mine.symlink_to(elsewhere)
    for final in (False, True):
        assert copy_metrics(mine, theirs, _me(), 0, final=final) == 0
    assert not theirs.exists()


def test_a_symlink_swapped_in_mid_job_is_not_followed(job, files):
    mine, theirs = files
    _append(mine, b'{"step": 0}\n')
    job.sync_metrics()
    elsewhere = mine.parent.parent / "secret.jsonl"
    elsewhere.write_bytes(b'{"step": 0}\n{"secret": "worker-only"}\n')
    mine.unlink()
    mine.symlink_to(elsewhere)
    job.finish()
    assert theirs.read_bytes() == b'{"step": 0}\n'


def test_a_file_of_another_user_is_not_copied(files, caplog):
    """The job's user is someone else than the file's owner (here: the file is ours)."""
    mine, theirs = files
    theirs.parent.mkdir()
    _append(mine, b'{"step": 0}\n')
    other = JobUser(name="other", uid=os.getuid() + 1, gid=os.getgid(), switch=True)
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        at = copy_metrics(mine, theirs, other, 0, final=True)
    assert at == sandbox.MAX_METRICS_BYTES  # and never looked at again
    assert not theirs.exists()
    assert "not the job's own regular file" in caplog.text


@as_root
def test_a_file_given_to_another_uid_is_not_copied(job, files):
    mine, theirs = files
    _append(mine, b'{"step": 0}\n')
    job.sync_metrics()
    assert job.copied == 12
    foreign = mine.parent.parent / "foreign.jsonl"
    foreign.write_bytes(b'{"step": 0}\n{"theirs": "nobody\'s"}\n')
    os.chown(foreign, NOBODY_UID, NOBODY_UID)
    os.replace(foreign, mine)
    job.sync_metrics()
    assert job.copied == sandbox.MAX_METRICS_BYTES
    os.chown(mine, os.getuid(), os.getgid())  # even when it is ours again: nothing more
    _append(mine, b'{"step": 2}\n')
    job.finish()
    assert theirs.read_bytes() == b'{"step": 0}\n'


def test_a_fifo_is_not_copied(files):
    mine, theirs = files
    theirs.parent.mkdir()
    mine.unlink()
    os.mkfifo(mine)
    writer = os.open(mine, os.O_RDWR | os.O_NONBLOCK)  # a writer that never stops
    try:
        os.write(writer, b'{"step": 0}\n')
        assert copy_metrics(mine, theirs, _me(), 0, final=True) == sandbox.MAX_METRICS_BYTES
    finally:
        os.close(writer)
    assert not theirs.exists()


def test_a_folder_swapped_in_is_not_copied(job, files):
    mine, theirs = files
    _append(mine, b'{"step": 0}\n')
    job.sync_metrics()
    mine.unlink()
    mine.mkdir()  # the job's own folder: it may do this
    job.sync_metrics()
    job.finish()
    assert theirs.read_bytes() == b'{"step": 0}\n'


def test_nothing_past_the_bound_is_copied(job, files, monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_METRICS_BYTES", 20)
    mine, theirs = files
    _append(mine, b"0123456789\nabc")
    job.sync_metrics()
    assert job.copied == 11
    assert theirs.read_bytes() == b"0123456789\n"
    _append(mine, b"defghijklmno\n")
    job.sync_metrics()  # the bound is reached: its part of a line is copied too
    assert job.copied == 20
    assert theirs.read_bytes() == b"0123456789\nabcdefghi"
    _append(mine, b'{"more": 1}\n')
    job.sync_metrics()
    job.finish()
    assert job.copied == 20
    assert theirs.read_bytes() == b"0123456789\nabcdefghi"


def test_a_file_past_the_bound_at_once(files, monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_METRICS_BYTES", 16)
    mine, theirs = files
    theirs.parent.mkdir()
    _append(mine, b"0123456789\n" * 5)
    assert copy_metrics(mine, theirs, _me(), 0, final=False) == 16
    assert theirs.read_bytes() == b"0123456789\n01234"
    assert copy_metrics(mine, theirs, _me(), 16, final=True) == 16
    assert copy_metrics(mine, theirs, _me(), 30, final=True) == 30  # past it: nothing
    assert theirs.read_bytes() == b"0123456789\n01234"


def test_an_unwritable_launchers_file_does_not_raise(files, caplog):
    mine, theirs = files
    theirs.mkdir(parents=True)  # a folder where the file should be
    _append(mine, b'{"step": 0}\n')
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        copy_metrics(mine, theirs, _me(), 0, final=True)
    assert "could not copy the job's metrics" in caplog.text
    assert theirs.is_dir()
