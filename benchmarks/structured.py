"""Structured output on its own: the structured section of ``kvshelf bench`` (see
``kvbench.structured`` for the method).

    python benchmarks/structured.py [--schemas 20] [--cases tool:1-18] [--model embedded]
    python benchmarks/structured.py --merge OUT RUN_DIR [RUN_DIR ...]

For each schema, the share of replies that parse and validate, constrained vs
unconstrained, and ms/token with and without the mask, side by side in one run, beside
the step's floor (weight bytes over the bandwidth measured in the run); plus the mask's
own cost per token (computed beside the step, applied on it) against the step.

The unconstrained reply is not masked but checked as it is written: a validator (the
schema's grammar, llguidance's matcher consuming the sampled tokens, ``Grammar(enforced=
False)``) ends it at the first token after which it can no longer become valid, and the
reply is recorded invalid with that token and the reason. Before it, an unconstrained
reply of the 270M model ran on to ``max_tokens`` (up to 704 tokens); a reply that
completes is validated with ``jsonschema`` exactly as a constrained one.

Sizes: ``--schemas N`` takes N tool and N JSON schemas, their sizes spread over 1..20
fields; ``--cases`` takes the cases named (``tool:1-18``, ``tool:19-20,json:1-20``), so the
full 20 + 20 runs as two parts of under 10 minutes each on 2 cores (about 5,500
constrained tokens at ~150 ms/token), each still side by side; ``--deadline-s`` starts no
case after that many seconds. ``--merge`` writes one TABLE.md and structured.json from
the parts' folders. Writes benchmarks/results/structured-<time>/ (REPORT.md,
results.json, TABLE.md, structured-rows.jsonl, structured.png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from kvbench.runner import run
from kvbench.settings import Settings


def merge(out: Path, parts: list[Path]) -> Path:
    """One table of every part's rows (a case run twice keeps its last run)."""
    from kvbench.structured import _names, _summary, table_md

    rows: dict[tuple[str, int], dict] = {}
    runs = []
    for part in parts:
        result = json.loads((part / "results.json").read_text())["sections"]["structured"]
        for row in result["rows"]:
            rows[(row["kind"], row["fields"])] = row
        cases = [{"kind": r["kind"], "fields": r["fields"]} for r in result["rows"]]
        runs.append(
            {
                "name": part.name,
                "cases": _names(cases),
                "floor": result["floor"],
                "load_start": result["load_average_start"],
                "load_end": result["load_average"],
                "elapsed_s": result["elapsed_s"],
            }
        )
    ordered = sorted(rows.values(), key=lambda r: (r["kind"] != "tool", r["fields"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "TABLE.md").write_text(table_md(ordered, runs))
    floor = min(r["floor"]["floor_ms"] for r in runs)
    merged = {"runs": runs, "summary": _summary(ordered, floor), "rows": ordered}
    (out / "structured.json").write_text(json.dumps(merged, indent=1, default=str))
    return out / "TABLE.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=20, help="tool and JSON schemas each, sizes spread over 1..20")
    parser.add_argument("--cases", default="", help="the cases to run, e.g. tool:1-18 or tool:19-20,json:1-20")
    parser.add_argument("--max-tokens", type=int, default=64, help="per reply, plus --tokens-per-field per field")
    parser.add_argument("--tokens-per-field", type=int, default=32)
    parser.add_argument("--kinds", default="tool,json", help="tool, json or both")
    parser.add_argument("--modes", default="free,constrained", help="free, constrained or both")
    parser.add_argument("--fields", default="", help="schema sizes to run, e.g. 14,20 (overrides --schemas)")
    parser.add_argument("--reference-tokens", type=int, default=64, help="the unconstrained step's free decode")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no case after this (0: no limit)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR", help="OUT then the parts' folders")
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    if args.merge:
        print(f"wrote {merge(args.merge[0], args.merge[1:])}")
        return
    settings = Settings(
        sections=("structured",),
        structured_schemas=args.schemas,
        structured_max_tokens=args.max_tokens,
        structured_tokens_per_field=args.tokens_per_field,
        structured_kinds=tuple(k for k in args.kinds.split(",") if k),
        structured_modes=tuple(m for m in args.modes.split(",") if m),
        structured_fields=tuple(int(k) for k in args.fields.split(",") if k),
        structured_cases=tuple(c for c in args.cases.split(",") if c),
        structured_deadline_s=args.deadline_s,
        structured_reference_tokens=args.reference_tokens,
    )
    out = Path(__file__).parent / "results" / f"structured-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"wrote {run(settings, args.model, out)}")


if __name__ == "__main__":
    main()
