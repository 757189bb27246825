"""The report's table in the formats a paper's build reads, beside ``report.md``: ``report.csv`` and
``report.json`` (each row as numbers: mean, sample std and n over seeds, the p-value, the paper's row) and
``report.tex`` (the table as ``report.md`` shows it, a LaTeX ``tabular`` to ``\\input``). Each is written
atomically; the same rows, in the same order, as ``report.md``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from aiayn.experiments.report.table import Table
from aiayn.experiments.table3 import COLUMNS
from aiayn.files import atomic_write

REPORT_FORMAT = 1  # report.json's layout: bump when a field changes meaning
STATISTICS = ("val_ppl", "val_bleu", "best_val_bleu", "test_bleu")  # each as <key>_mean, _std, _n in the CSV
# A LaTeX rendering of each character of a cell that is special to LaTeX or outside its default fonts.
LATEX = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "×": r"$\times$",
    "⁶": r"$^{6}$",
    "‡": r"$\ddagger$",
    "≤": r"$\leq$",
    "−": "-",
    "→": r"$\to$",
}


def write_exports(table: Table, folder: Path) -> list[Path]:
    """``report.csv``, ``report.json`` and ``report.tex`` of ``table`` in ``folder``; returns their paths."""
    paths = [folder / name for name in ("report.csv", "report.json", "report.tex")]
    atomic_write(paths[0], csv_text(table))
    atomic_write(paths[1], json.dumps({"format": REPORT_FORMAT, "rows": list(table.records)}, indent=2) + "\n")
    atomic_write(paths[2], latex_table(table))
    return paths


def csv_row(record: dict[str, Any]) -> dict[str, Any]:
    """A row of ``report.csv``: the flat fields of a record (:func:`~.table.row_record`)."""
    paper = record["paper"] or {}
    row = {"setting": record["setting"], **{heading: record["columns"].get(heading) for heading, _ in COLUMNS}}
    row |= {key: record[key] for key in ("params", "seeds", "steps", "checkpoint", "answer")}
    for key in STATISTICS:
        row |= {f"{key}_{part}": record[key][part] for part in ("mean", "std", "n")}
    tested = ("test_sentences", "partial_test", "p_test", "p_note", "significant", "minutes")
    row |= {key: record[key] for key in tested}
    if (comet := record["comet"]) is not None:
        row["comet_model"] = comet["model"]
        row |= {f"test_comet_{part}": comet["test"][part] for part in ("mean", "std", "n")}
        row |= {"p_comet": comet["p_test"], "p_comet_note": comet["p_note"], "comet_significant": comet["significant"]}
    for point in record["val_bleu_matched"]:  # every row has the same points (the table's matched columns)
        row[f"matched_{point['axis']}"] = point["at"]
        row |= {f"val_bleu_at_matched_{point['axis']}_{part}": point[part] for part in ("mean", "std", "n")}
    row |= {f"paper_{key}": paper.get(key) for key in ("row", "ppl", "bleu", "params_millions")}
    return row


def csv_text(table: Table) -> str:
    """``report.csv``: a header and a row per setting; an empty cell where there is no value."""
    rows = [csv_row(record) for record in table.records]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["setting"], lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: "" if value is None else value for key, value in row.items()} for row in rows)
    return out.getvalue()


def latex_cell(text: str) -> str:
    """``text`` as LaTeX typesets it (:data:`LATEX`)."""
    return "".join(LATEX.get(char, char) for char in text)


def latex_table(table: Table) -> str:
    """``report.tex``: the cells of ``report.md``'s table in a ``tabular`` (the setting left, the rest
    right-aligned), with rules under the header and at the ends."""
    columns = "l" + "r" * (len(table.header) - 1)
    lines = [f"\\begin{{tabular}}{{{columns}}}", r"\hline"]
    lines.append(" & ".join(latex_cell(heading) for heading in table.header) + r" \\")
    lines.append(r"\hline")
    lines += [" & ".join(latex_cell(cell) for cell in row) + r" \\" for row in table.rows]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"
