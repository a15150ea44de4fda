"""The cloud's own bill: its export read into `BillLine`s (`aws_cur2`, `gcp_billing`,
`files`), and the rules that true the ledger up from it (`trueup`). The ledger keeps what was
imported and what it booked (`admission/ledger/bills.py`)."""
