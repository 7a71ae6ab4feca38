"""The finance domain kit: financial document analysis whose every conclusion is checked against raw data.

Reading order: `generate` (filings whose statements reconcile; Markdown, HTML, PDF), `verify` (amounts
with units, ratios, the altered cell, cited conclusions), `families` (five levels; `FAMILIES`, merged
by rlvr.tasks.registry), `env` (FinanceDocsEnv: search, PDF tables, calculator, python).
"""
