"""Which grammar library makes kvshelf's token masks: llguidance, xgrammar or outlines-core, measured.

Issue 17 asks for llguidance unless xgrammar or outlines-core serve better on MLX's CPU
and Metal backends. A mask is computed on the CPU by all three (none has an MLX or Metal
kernel; xgrammar's GPU kernels are CUDA/Triton only), as 32-bit words of allowed-token
bits, which kvshelf unpacks into one boolean row and applies with ``mx.where`` on the
device, the same for all: so what tells them apart is the CPU work per token and per
schema, and what each can enforce. For the structured benchmark's 40 schemas (20 tool
calls, 20 JSON records of 1..20 fields) and the embedded model's tokenizer (Gemma 3,
262,144 tokens), per library:

- **setup**: building its view of the vocabulary, once per model;
- **compile**: from the schema to the first mask (the grammar, the matcher, the first
  mask: llguidance and outlines-core do part of their work on first use);
- **mask per token**, median and p99: computing the next mask into the library's bitmask
  and unpacking it to the boolean row MLX takes, over a realistic token sequence: the
  constrained replies recorded by ``benchmarks/structured.py`` (their JSON object: a
  call's ``{"name": ..., "arguments": ...}``), tokenized as the model's tokenizer does;
- **refuses**: a schema the library will not compile (its words), and whether it accepts
  every token of the recorded replies (a valid reply refused is a failure).

Each library gets the schema kvshelf sends (``kvshelf.structured.grammar.closed``:
objects closed, numbers bounded to ±(2**53-1) with at most 10 fraction digits) in
kvshelf's JSON style (", " and ": ", no free whitespace). Where a library refuses that,
it is tried again on the declared schema with its objects closed only (what it could
enforce, looser than kvshelf needs), and the row says so.

Two steps, since the libraries live in a throwaway venv and kvshelf in the project's:

    # 1. the cases (schemas as kvshelf sends them, the replies' texts), with the project's Python
    PYTHONPATH=.typecheck .venv/bin/python benchmarks/grammar_libs.py export \\
        --rows benchmarks/results/structured-*/structured-rows.jsonl --out /tmp/grammar-cases.json
    # 2. the measurement, with any Python that has the libraries (under kv-bench: it is timed)
    python3 -m venv /tmp/gramvenv && /tmp/gramvenv/bin/pip install llguidance xgrammar outlines-core \\
        tokenizers transformers numpy
    kv-bench /tmp/gramvenv/bin/python benchmarks/grammar_libs.py measure --cases /tmp/grammar-cases.json \\
        --tokenizer ~/.cache/kvshelf/models/gemma3-270m/tokenizer.json --out benchmarks/results/grammar-libs-<time>.json

outlines-core builds each schema's index in a child process with a time limit
(``--timeout-s``); a size that runs out of time is not tried larger, and ``--budget-s``
bounds each library's total, so the run stays within minutes; what was not run says so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

JSON_STYLE = {"item_separator": ", ", "key_separator": ": "}


# -- step 1: export (project venv) -----------------------------------------------------
def export(rows_files: list[Path], out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from kvbench.structured import json_cases, tool_cases
    from kvshelf.structured.grammar import closed

    replies: dict[tuple[str, int], str] = {}
    for path in rows_files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            text = row.get("constrained_reply") or _older(row)
            if row.get("constrained_valid") and text:
                if row["kind"] == "tool":  # the call's JSON object, without the tags
                    text = text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
                replies[(row["kind"], row["fields"])] = text
    cases = []
    for case in tool_cases(list(range(1, 21))) + json_cases(list(range(1, 21))):
        key = (case["kind"], case["fields"])
        if case["kind"] == "tool":
            name = f"store_record_{case['fields']}"
            sent = {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": closed(case["schema"])},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            declared = {**sent, "properties": {"name": {"const": name}, "arguments": case["schema"]}}
        else:
            sent, declared = closed(case["schema"]), case["schema"]
        cases.append(
            {"kind": key[0], "fields": key[1], "schema": sent, "declared": declared, "reply": replies.get(key)}
        )
    out.write_text(json.dumps(cases, indent=1))
    print(f"wrote {out}: {len(cases)} cases, {sum(c['reply'] is not None for c in cases)} with a reply")


def _older(row: dict[str, Any]) -> str | None:
    """The reply of a row written before ``constrained_reply`` was (its ``reply``: the
    JSON text, or the calls in OpenAI's shape)."""
    reply = row.get("reply")
    if isinstance(reply, str):
        return reply
    if isinstance(reply, list) and reply:
        fn = reply[0]["function"]
        args = json.dumps(json.loads(fn["arguments"]), ensure_ascii=False)
        return f'{{"name": {json.dumps(fn["name"])}, "arguments": {args}}}'
    return None


# -- step 2: measure (any venv with the libraries) -------------------------------------
class Lib:
    """One library behind the same three calls: compile a schema, mask, accept a token."""

    name = ""
    isolated = False  # compile in a child process, killed past the time limit (a compile may not end soon)

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        self.vocab_size = vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def mask(self, state: Any) -> Any:  # the bitmask words (np.int32/uint32 array or bytes)
        raise NotImplementedError

    def accept(self, state: Any, token: int) -> bool:
        raise NotImplementedError


class Llguidance(Lib):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        import llguidance

        super().__init__(tokenizer_json, vocab_size, eos)
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos, slices=None)
        self.version = _version("llguidance")

    def compile(self, schema: dict[str, Any]) -> Any:
        source = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps({**schema, "x-guidance": {**JSON_STYLE, "whitespace_flexible": False}})
        )
        error = self.llg.LLMatcher.validate_grammar(source)
        if error:
            raise ValueError(error)
        return self.llg.LLMatcher(self.tok, source, log_level=0)

    def mask(self, state: Any) -> Any:
        return state.compute_bitmask()

    def accept(self, state: Any, token: int) -> bool:
        return bool(state.consume_token(token))


class Xgrammar(Lib):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        from transformers import PreTrainedTokenizerFast

        xgrammar = importlib.import_module("xgrammar")  # not a project dependency: no types here

        super().__init__(tokenizer_json, vocab_size, eos)
        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=_hf_tokenizer(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 2)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.version = _version("xgrammar")

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema),
            any_whitespace=False,
            separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]),
            strict_mode=True,
        )
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, state: Any) -> Any:
        state.fill_next_token_bitmask(self.bitmask)
        return self.bitmask.numpy()

    def accept(self, state: Any, token: int) -> bool:
        return bool(state.accept_token(token))


class OutlinesCore(Lib):
    name = "outlines-core"
    isolated = True  # its index walks the whole vocabulary through the regex's automaton

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        import llguidance  # only to read each token's bytes the way the tokenizer decodes them
        import numpy as np

        outlines_core = importlib.import_module("outlines_core")

        super().__init__(tokenizer_json, vocab_size, eos)
        self.oc = outlines_core
        tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos, slices=None)
        tokens: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if i in eos or tok.is_special_token(i):
                continue
            tokens.setdefault(tok.decode_bytes([i]), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], tokens)
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.version = _version("outlines-core")

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "[ ]?")  # admits kvshelf's ", "
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary))

    def mask(self, state: Any) -> Any:
        state.write_mask_into(self.words.ctypes.data, self.words.size, self.words.itemsize)
        return self.words

    def accept(self, state: Any, token: int) -> bool:
        try:
            state.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


LIBS = {cls.name: cls for cls in (Llguidance, Xgrammar, OutlinesCore)}

# What kvshelf relies on a grammar to enforce, each as one field's schema (in an object
# closed as kvshelf closes it) and a reply prefix that must be refused. A library that
# compiles a schema but lets its prefix through has loosened the schema in silence.
PROBES: dict[str, tuple[dict[str, Any], str]] = {
    "10 fraction digits (multipleOf 1e-10)": (
        {"type": "number", "minimum": -(2**53 - 1), "maximum": 2**53 - 1, "multipleOf": 1e-10},
        '{"x": 3.00000000000',
    ),
    "number bounds (maximum 2**53-1)": (
        {"type": "number", "minimum": -(2**53 - 1), "maximum": 2**53 - 1, "multipleOf": 1e-10},
        '{"x": 33333333333333333',
    ),
    "integer bounds (maximum 120)": ({"type": "integer", "minimum": 0, "maximum": 120}, '{"x": 121'),
    "additionalProperties false": ({"type": "string"}, '{"y'),
    "maxLength 5": ({"type": "string", "maxLength": 5}, '{"x": "abcdef'),
    "pattern ^[a-z]{2}$": ({"type": "string", "pattern": "^[a-z]{2}$"}, '{"x": "abc'),
    "format date": ({"type": "string", "format": "date"}, '{"x": "2020-13'),
    "format email": ({"type": "string", "format": "email"}, '{"x": "no space@'),
}


def probe(lib: Lib, tok: Any) -> dict[str, str]:
    """For each of ``PROBES``: "enforced", "NOT enforced" (compiled, prefix let through)
    or the refusal."""
    out = {}
    for what, (field, prefix) in PROBES.items():
        schema = {"type": "object", "properties": {"x": field}, "required": ["x"], "additionalProperties": False}
        try:
            state = lib.compile(schema)
        except Exception as exc:  # noqa: BLE001
            out[what] = f"refused: {' '.join(str(exc).split())[:160]}"
            continue
        allowed = _unpack(lib.mask(state), lib.vocab_size)
        through = True
        for token in tok.encode(prefix, add_special_tokens=False).ids:
            if not allowed[token] or not lib.accept(state, token):
                through = False
                break
            allowed = _unpack(lib.mask(state), lib.vocab_size)
        out[what] = "NOT enforced" if through else "enforced"
    return out


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _hf_tokenizer(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def _unpack(words: Any, width: int) -> Any:
    import numpy as np

    raw = np.frombuffer(words, dtype=np.uint8) if isinstance(words, bytes) else words.view(np.uint8).ravel()
    return np.unpackbits(raw, bitorder="little")[:width].astype(bool)


class _Box:
    """A queue of one, for a library measured in this process."""

    value: dict[str, Any] = {}

    def put(self, value: dict[str, Any]) -> None:
        self.value = value


def _one(lib: Lib, case: dict[str, Any], tokens: list[int], out: Any) -> None:
    """Compile ``case``'s schema and replay ``tokens`` (in a child process)."""
    result: dict[str, Any] = {}
    for variant in ("schema", "declared"):
        try:
            t0 = time.perf_counter()
            state = lib.compile(case[variant])
            first = lib.mask(state)
            result["compile_ms"] = (time.perf_counter() - t0) * 1000
            result["variant"] = "kvshelf's schema" if variant == "schema" else "declared, objects closed"
            break
        except Exception as exc:  # noqa: BLE001  (a library's refusal is the finding)
            result.setdefault("refused", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    else:
        out.put(result)
        return
    compute, total = [], []
    allowed = _unpack(first, lib.vocab_size)
    for i, token in enumerate(tokens):
        if not allowed[token] or not lib.accept(state, token):
            result["refused_reply_at"] = i
            break
        t0 = time.perf_counter()
        words = lib.mask(state)
        t1 = time.perf_counter()
        allowed = _unpack(words, lib.vocab_size)
        t2 = time.perf_counter()
        compute.append((t1 - t0) * 1000)
        total.append((t2 - t0) * 1000)
    if total:
        result |= {
            "tokens": len(total),
            "mask_compute_ms": statistics.median(compute),
            "mask_ms": statistics.median(total),
            "mask_p99_ms": sorted(total)[min(len(total) - 1, int(0.99 * len(total)))],
        }
    out.put(result)


def measure(
    cases_file: Path, tokenizer_file: Path, out: Path, libs: list[str], timeout_s: float, budget_s: float
) -> None:
    from tokenizers import Tokenizer

    cases = json.loads(cases_file.read_text())
    tokenizer_json = tokenizer_file.read_text()
    tok = Tokenizer.from_str(tokenizer_json)
    vocab_size = 262144 if tok.get_vocab_size() <= 262144 else tok.get_vocab_size()
    eos = [i for i in (tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")) if i is not None]
    load_start = list(os.getloadavg())
    report: dict[str, Any] = {"cases": len(cases), "vocab_size": vocab_size, "libraries": {}}
    ctx = mp.get_context("fork")
    for name in libs:
        t0 = time.perf_counter()
        try:
            lib = LIBS[name](tokenizer_json, vocab_size, eos)
        except Exception as exc:  # noqa: BLE001
            report["libraries"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            continue
        setup_s = time.perf_counter() - t0
        rows: list[dict[str, Any]] = []
        timed_out_at: dict[str, int] = {}
        spent = 0.0
        for case in cases:
            row: dict[str, Any] = {"kind": case["kind"], "fields": case["fields"]}
            if case["kind"] in timed_out_at or spent > budget_s:
                row["not_run"] = (
                    f"{case['kind']} {timed_out_at[case['kind']]} ran past {timed_out_at and timeout_s:.0f} s"
                    if case["kind"] in timed_out_at
                    else f"the library's budget of {budget_s:.0f} s was spent"
                )
                rows.append(row)
                continue
            tokens = tok.encode(case["reply"], add_special_tokens=False).ids if case["reply"] else []
            t1 = time.perf_counter()
            if lib.isolated:
                queue = ctx.Queue()
                child = ctx.Process(target=_one, args=(lib, case, tokens, queue))
                child.start()
                child.join(timeout_s)
                if child.is_alive():
                    child.kill()
                    child.join()
                    row["timeout"] = f"compile and replay ran past {timeout_s:.0f} s"
                    timed_out_at[case["kind"]] = case["fields"]
                else:
                    row |= queue.get() if not queue.empty() else {"error": f"the child exited {child.exitcode}"}
            else:
                done: Any = _Box()
                _one(lib, case, tokens, done)
                row |= done.value
            spent += time.perf_counter() - t1
            rows.append(row)
            print(f"  {name:13s} {case['kind']} {case['fields']:2d}: {json.dumps(row)[:200]}", flush=True)
        probes = probe(lib, tok)
        print(f"  {name}: {probes}", flush=True)
        report["libraries"][name] = {
            "version": lib.version,
            "setup_s": setup_s,
            "rows": rows,
            "summary": _summary(rows),
            "enforces": probes,
        }
    report["load_average"] = {"start": load_start, "end": list(os.getloadavg())}
    report["cpus"] = os.cpu_count()
    out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {out}")


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if "compile_ms" in r]
    median = lambda key: statistics.median([r[key] for r in ran if key in r]) if ran else None  # noqa: E731
    return {
        "compiled": len(ran),
        "of": len(rows),
        "kvshelf_schema": sum(r.get("variant") == "kvshelf's schema" for r in ran),
        "refused": [
            f"{r['kind']} {r['fields']}: {r['refused']}" for r in rows if "refused" in r and "compile_ms" not in r
        ],
        "loosened": [f"{r['kind']} {r['fields']}: {r['refused']}" for r in ran if "refused" in r],
        "timeouts": sum("timeout" in r for r in rows),
        "not_run": sum("not_run" in r for r in rows),
        "refused_a_valid_reply": [
            f"{r['kind']} {r['fields']} at token {r['refused_reply_at']}" for r in ran if "refused_reply_at" in r
        ],
        "compile_ms_median": median("compile_ms"),
        "compile_ms_max": max((r["compile_ms"] for r in ran), default=None),
        "mask_ms_median": median("mask_ms"),
        "mask_compute_ms_median": median("mask_compute_ms"),
        "mask_p99_ms_median": median("mask_p99_ms"),
        "mask_p99_ms_max": max((r["mask_p99_ms"] for r in ran if "mask_p99_ms" in r), default=None),
    }


def table(report: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        "| library | setup | schemas compiled (kvshelf's / all) | compile median / max | mask per token median "
        "(compute) | p99 median / max | refused | valid replies refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, lib in report["libraries"].items():
        if "error" in lib:
            lines.append(f"| {name} | {lib['error']} | | | | | | |")
            continue
        s = lib["summary"]
        refused = len(s["refused"]) + len(s["loosened"])
        missing = f" ({s['timeouts']} timed out, {s['not_run']} not run)" if s["timeouts"] or s["not_run"] else ""
        lines.append(
            f"| {name} {lib['version']} | {lib['setup_s']:.1f} s | {s['kvshelf_schema']} / {s['compiled']} of "
            f"{s['of']}{missing}"
            f" | {f(s['compile_ms_median'], '.1f')} / {f(s['compile_ms_max'], '.1f')} ms | "
            f"{f(s['mask_ms_median'])} ({f(s['mask_compute_ms_median'])}) ms | {f(s['mask_p99_ms_median'])} / "
            f"{f(s['mask_p99_ms_max'])} ms | {refused} | {len(s['refused_a_valid_reply'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    ex = sub.add_parser("export", help="the cases, with the project's Python")
    ex.add_argument("--rows", nargs="+", type=Path, required=True, help="structured-rows.jsonl of structured runs")
    ex.add_argument("--out", type=Path, required=True)
    me = sub.add_parser("measure", help="the libraries, with a Python that has them")
    me.add_argument("--cases", type=Path, required=True)
    me.add_argument("--tokenizer", type=Path, required=True, help="the model's tokenizer.json")
    me.add_argument("--out", type=Path, required=True)
    me.add_argument("--libs", default="llguidance,xgrammar,outlines-core")
    me.add_argument("--timeout-s", type=float, default=30.0, help="per library and schema")
    me.add_argument("--budget-s", type=float, default=120.0, help="per library, all schemas")
    me.add_argument("--table", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    if args.step == "export":
        export(args.rows, args.out)
    elif args.table:
        print(table(json.loads(args.out.read_text())))
    else:
        measure(args.cases, args.tokenizer, args.out, args.libs.split(","), args.timeout_s, args.budget_s)


if __name__ == "__main__":
    main()
