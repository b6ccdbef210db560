"""The ``--models`` table of benchmarks/decode_attention.py: real models'
per-rank attention shapes (TP 1), the rows timed for each, and the groups one
GPU run takes. Nothing here needs a GPU or the kernels.

    python -m benchmarks.decode_attention --models --list       # the plan, CPU only
    python -m benchmarks.decode_attention --models --group 1    # one GPU run (group 2 likewise)
    python -m benchmarks.decode_attention --models --merge      # g1 + g2 -> decode_attention_models.*

Every model is the Flint preset with its head counts, head_dim, layer kinds
and window replaced, sinks off (Flint has sinks; these models don't) and
16-token pages (the flint HND cache of the other modes). Rows: B = 1 at
L = 1k and 32k, B = 8 / 64 / 128 at L = 8k, full attention; the Gemmas also
B = 32 x 8k with window 1024. A window row's spec carries that window
(``sliding_window=1024``): the launch config is chosen from the spec's window
(the op takes any runtime window, "correct, just not tuned"); today 512,
1024 and 4096 are all past the short-window band (32 slices), so the variants
are the ones of the model's own spec and nothing extra compiles.

Peers, as their sources read (FlashInfer 0.6.18 snapshot, FA4 at 0251105):
XQA JIT-compiles one nvcc module per (dtype, page, head_dim, GQA, sliding);
it takes head_dim multiples of 16 up to 256 (512 in newer releases; 96 runs
padded to 128), any GQA, pages 16-128, and has no logit softcap (Gemma-2's
XQA rows run without it). FA4 on sm_90 takes head_dim 8..256 (multiples of
8) and ``softcap=``, but has no split-KV there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from flintgen.presets import FLINT
from flintgen.spec import Spec

PAGE = 16                     # tokens per page: the flint HND cache of the other modes
MAX_ROWS_PER_GROUP = 24       # one GPU run: about 24 rows and 8 minutes with XQA's nvcc compiles
FLOOR_GOAL_PCT = 92.0         # at B = 128 x 8k, of the read floor, for every shape
FLOOR_GOAL_BATCH = 128



@dataclass(frozen=True)
class Model:
    """One model's attention at TP 1, as its config.json has it. The
    per-rank attributes let a benchmark cache be built from it for a row that
    flintgen's Spec refuses (the peers still run it)."""

    name: str
    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    window: int | None = None           # the sliding layers' window
    softcap: float | None = None        # attention logit soft-cap
    note: str = ""

    # Duck-typed Spec attributes (benchmarks.decode_attention.Case).
    page_size = PAGE
    kv_cache_dtype = "bf16"
    sinks = False

    @property
    def q_heads_per_rank(self) -> int:
        return self.q_heads

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5    # Gemma's query_pre_attn_scalar 256 = head_dim

    @property
    def label(self) -> str:
        return f"{self.q_heads}/{self.kv_heads}"

    def spec(self, window: int | None = None) -> Spec:
        """The Flint preset with this model's shape; ``window``: the
        sliding layers' window instead of the model's. Raises ValueError
        where the Spec does not take the shape."""
        changes = dict(name=self.name.lower(), hidden_size=self.hidden_size, num_q_heads=self.q_heads,
                       num_kv_heads=self.kv_heads, head_dim=self.head_dim, page_size=PAGE, sinks=False,
                       sliding_window=window or self.window, layer_types=self.layer_types)
        if self.softcap is not None:
            changes["attn_logit_softcap"] = True
        return FLINT.replace(**changes)


def _full(n: int) -> tuple[str, ...]:
    return ("full",) * n


# Gemma-3: 5 sliding layers then 1 full (sliding_window_pattern 6), 26 layers.
_GEMMA3_LAYERS = (("sliding",) * 5 + ("full",)) * 4 + ("sliding",) * 2

MODELS = [
    Model("Phi-3-mini", 3072, 32, 32, 96, _full(32),
          note="config.json of the 4k model lists sliding_window 2047; timed as full attention"),
    Model("SmolLM2-1.7B", 2048, 32, 32, 64, _full(24)),
    Model("Gemma-2-9B", 3584, 16, 8, 256, ("sliding", "full") * 21, window=4096, softcap=50.0),
    Model("Gemma-3-1B", 1152, 4, 1, 256, _GEMMA3_LAYERS, window=512),
    Model("Qwen2.5-7B", 3584, 28, 4, 128, _full(28)),
    Model("Qwen2.5-14B", 5120, 40, 8, 128, _full(48)),
    Model("Llama-3.2-3B", 3072, 24, 8, 128, _full(28)),
    Model("Qwen3-1.7B", 2048, 16, 8, 128, _full(28)),
]
BY_NAME = {m.name.lower(): m for m in MODELS}

ROWS = ((1, 1024), (1, 32768), (8, 8192), (64, 8192), (128, 8192))   # (B, L), full attention
WINDOW_ROW = (32, 8192, 1024)                                         # (B, L, window): models with a window

# One GPU run each: 21 rows and 5 XQA modules to compile per group.
GROUPS = {
    1: ("Gemma-2-9B", "Phi-3-mini", "SmolLM2-1.7B", "Qwen2.5-7B"),
    2: ("Gemma-3-1B", "Qwen2.5-14B", "Llama-3.2-3B", "Qwen3-1.7B"),
}


@dataclass(frozen=True)
class PlanRow:
    model: Model
    batch: int
    seq_len: int
    window: int | None = None

    def spec(self) -> Spec:
        return self.model.spec(self.window)

    @property
    def floor_goal(self) -> bool:
        """The row where >= 92 % of the read floor is asked."""
        return self.batch == FLOOR_GOAL_BATCH and self.window is None

    @property
    def cache_bytes(self) -> int:
        m = self.model
        pages = -(-self.seq_len // PAGE)
        return self.batch * pages * PAGE * m.kv_heads * 2 * m.head_dim * 2

    def describe(self) -> str:
        w = f"window {self.window}" if self.window else "full"
        return f"B={self.batch:<3} L={self.seq_len:<5} {w:<11} cache {self.cache_bytes / 1e9:5.2f} GB"


def rows_for(model: Model) -> list[PlanRow]:
    rows = [PlanRow(model, b, L) for b, L in ROWS]
    if model.window is not None:
        rows.append(PlanRow(model, *WINDOW_ROW))
    return rows


def select(group: str | None = None, only: str | None = None) -> tuple[str, list[Model]]:
    """(results name, models) for ``--group N|all`` or ``--only NAME,NAME``."""
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n.lower() not in BY_NAME]
        if unknown:
            raise SystemExit(f"unknown model(s) {unknown}: known are {[m.name for m in MODELS]}")
        models = [BY_NAME[n.lower()] for n in names]
        return "decode_attention_models_" + "_".join(m.name.lower().replace(".", "") for m in models), models
    if group == "all":
        return "decode_attention_models", list(MODELS)
    if group is None or not group.isdigit() or int(group) not in GROUPS:
        raise SystemExit(f"--models needs --group {' / '.join(map(str, GROUPS))} / all, or --only NAME,NAME "
                         "(all 42 rows in one run exceed a GPU run's budget); --list shows the plan")
    return f"decode_attention_models_g{group}", [BY_NAME[n.lower()] for n in GROUPS[int(group)]]


def plan(models: list[Model]) -> list[PlanRow]:
    return [r for m in models for r in rows_for(m)]


def xqa_modules(rows: list[PlanRow]) -> set[tuple]:
    """XQA's JIT modules the rows need (one nvcc compile each on a bare machine)."""
    return {(PAGE, r.model.head_dim, r.model.gqa, r.window is not None) for r in rows}


def flintgen_status(row: PlanRow, target) -> tuple[Spec | None, str | None]:
    """(spec, None) when flintgen takes the row's shape, else (None, why).
    Config-level only: no kernel is built or loaded."""
    from flintgen.kernels import KERNELS

    try:
        spec = row.spec()
    except (TypeError, ValueError) as e:
        return None, f"spec refused: {e}"
    try:
        KERNELS["decode_attention"].variants(spec, target)
    except (NotImplementedError, ValueError) as e:
        return None, str(e)
    return spec, None


def softcap_note(model: Model) -> str:
    if model.softcap is None:
        return "—"
    return f"{model.softcap:g}: flintgen, FA4; not XQA"


def listing(target) -> str:
    """The row plan per group, with what flintgen's spec and config accept."""
    out = []
    for g, names in GROUPS.items():
        models = [BY_NAME[n.lower()] for n in names]
        rows = plan(models)
        out.append(f"group {g}: {len(rows)} rows, {len(xqa_modules(rows))} XQA modules to JIT-compile; "
                   f"python -m benchmarks.decode_attention --models --group {g}")
        for m in models:
            _, why = flintgen_status(PlanRow(m, 1, 1024), target)
            out.append(f"  {m.name}: {m.label} heads, head_dim {m.head_dim}, GQA {m.gqa}, window "
                       f"{m.window or '—'}, softcap {softcap_note(m)}")
            out.append(f"    flintgen: {'takes it' if why is None else 'refuses: ' + why.splitlines()[0][:140]}")
            if m.note:
                out.append(f"    note: {m.note}")
            for r in rows_for(m):
                _, row_why = flintgen_status(r, target)
                out.append(f"    {r.describe()}{'  (flintgen refuses this row)' if row_why and not why else ''}")
    total = sum(len(plan([BY_NAME[n.lower()] for n in ns])) for ns in GROUPS.values())
    out.append(f"{total} rows in {len(GROUPS)} groups")
    return "\n".join(out)


def merge(results_dir: str, groups=tuple(GROUPS)) -> tuple[list, float, dict, str]:
    """Rows, bandwidth, meta and notes of decode_attention_models_g*.json,
    for one decode_attention_models table (write_results(..., meta=))."""
    from benchmarks.harness import Row

    rows, runs = [], []
    fields = {f.name for f in dataclasses.fields(Row)}
    for g in groups:
        path = os.path.join(results_dir, f"decode_attention_models_g{g}.json")
        with open(path) as f:
            data = json.load(f)
        runs.append(data["meta"])
        rows += [Row(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
    first = runs[0]
    meta = {k: first[k] for k in ("date", "commit", "device", "sms", "torch", "cuda")}
    meta["runs"] = [{k: m[k] for k in ("benchmark", "date", "commit", "read_bandwidth_TBps")} for m in runs]
    notes = first["notes"] + " Merged from " + "; ".join(
        f"{m['benchmark']} ({m['date']}, commit {m['commit']}, {m['read_bandwidth_TBps']:.2f} TB/s)" for m in runs)
    return rows, first["read_bandwidth_TBps"] * 1e12, meta, notes


def prebuild(rows: list[PlanRow], root: str, target) -> int:
    """Compile the flintgen variants ``rows`` launch into cache root ``root``
    (the aot stage carries no compiler to the GPU machine). Rows flintgen
    refuses are skipped. Returns the number of variants."""
    from flintgen.cli import _build_one
    from flintgen.kernels import KERNELS

    kdef = KERNELS["decode_attention"]
    todo = {}
    for row in rows:
        spec, why = flintgen_status(row, target)
        if spec is None:
            continue
        op = kdef.bind(spec, target, lambda v: None)
        v = op._variants[row.window is not None][row.batch]
        todo.setdefault(v.name, (spec, v))
    for spec, v in todo.values():
        _build_one(spec, "decode_attention", v, target, root)
    return len(todo)
