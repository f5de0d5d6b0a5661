"""Runs focus-validator on one data file and writes what it found as JSON.

tools/focus-validate runs this with the Python of the validator's own virtual environment
(.venv-focus), in a scratch directory that holds focus_validator/rules/currency_codes.csv
(focus-validator reads that file relative to the working directory). Usage:

    python worker.py REQUEST.json RESULT.json

REQUEST.json: {"data_file", "rule_set_path", "version", "applicability_criteria" (list),
"junit" (path of the JUnit XML that focus-validator writes), "value_columns" (list)}.

RESULT.json: {"rows", "columns", "model_version", "rules": {rule id: {"status": "pass" | "fail" |
"skip", "message", "violations", "samples"}}, "values": {column: {value: {"count", "rows"}}}}.
"values" lists, for each of value_columns in the file, every distinct non-null value with the
1-based numbers of the first data rows holding it: focus-validator checks allowed values over the
whole column, so focus-validate checks them row by row from this.

Nothing is decided here: focus-validate reads the model and judges the results.
"""

from __future__ import annotations

import csv
import json
import sys

MAX_ROWS_PER_VALUE = 5
MAX_SAMPLES = 2


def rule_results(results) -> dict:
    out = {}
    for rule_id, entry in results.by_rule_id.items():
        details = entry.get("details") or {}
        if details.get("skipped"):
            status = "skip"
        else:
            status = "pass" if entry.get("ok") else "fail"
        samples = []
        cases = details.get("failure_cases")
        if status == "fail" and cases is not None and hasattr(cases, "head"):
            for row in cases.head(MAX_SAMPLES).to_dict("records"):
                samples.append({str(k): str(v) for k, v in row.items()})
        try:
            violations = int(details.get("violations"))
        except (TypeError, ValueError):
            violations = None
        out[rule_id] = {
            "status": status,
            "message": str(details.get("message") or details.get("reason") or details.get("error") or ""),
            "violations": violations,
            "samples": samples,
        }
    return out


def column_values(path: str, wanted: list[str]) -> tuple[list[str], int, dict]:
    """The file's columns, its row count, and where each value of the wanted columns is."""
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        columns = list(pf.schema_arrow.names)
        present = [c for c in wanted if c in columns]
        table = pf.read(columns=present)
        nrows = pf.metadata.num_rows
        data = {c: table.column(c).to_pylist() for c in present}
        rows = ({c: data[c][i] for c in present} for i in range(nrows))
    else:
        handle = open(path, newline="", encoding="utf-8-sig")
        reader = csv.DictReader(handle)
        columns = list(reader.fieldnames or [])
        present = [c for c in wanted if c in columns]
        rows = reader
    values: dict[str, dict] = {c: {} for c in present}
    n = 0
    for n, row in enumerate(rows, start=1):
        for c in present:
            v = row[c]
            if v is None or v == "":  # null: nullability is focus-validator's job
                continue
            seen = values[c].setdefault(str(v), {"count": 0, "rows": []})
            seen["count"] += 1
            if len(seen["rows"]) < MAX_ROWS_PER_VALUE:
                seen["rows"].append(n)
    return columns, n, values


def main() -> None:
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as f:
        req = json.load(f)

    from focus_validator.validator import Validator

    validator = Validator(
        data_filename=req["data_file"],
        output_type="unittest",
        output_destination=req["junit"],
        rule_set_path=req["rule_set_path"],
        rules_version=req["version"],
        rules_block_remote_download=True,  # never reach out to GitHub: the model is local
        focus_dataset="CostAndUsage",
        applicability_criteria=",".join(req["applicability_criteria"]) or None,
        show_violations=True,
    )
    results = validator.validate()
    columns, nrows, values = column_values(req["data_file"], req["value_columns"])
    out = {
        "rows": nrows,
        "columns": columns,
        "model_version": getattr(results, "model_version", None),
        "rules": rule_results(results),
        "values": values,
    }
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
