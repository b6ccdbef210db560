"""The README's table of served models, generated from the shipped config.json
files (examples/hf_configs/) through ``flintgen.spec_from_hf_config``.

    python tools/served_models.py           # print the table
    python tools/served_models.py --write   # replace it in README.md (between the markers)

tests/test_hf_configs.py checks that README.md holds what this prints and
that every row's kernels build.
"""

from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "examples", "hf_configs")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- served-models:start -->", "<!-- served-models:end -->"
TPS = (1, 2, 4, 8)


def _gqa_per_rank(spec, tp: int) -> str:
    try:
        s = spec.replace(tp_size=tp)
    except ValueError:
        return "—"
    return f"{s.q_heads_per_rank // s.kv_heads_per_rank}"


def _window(spec) -> str:
    if not spec.has_sliding:
        return "—"
    n, k = len(spec.layer_types), spec.layer_types.count("sliding")
    return f"{spec.sliding_window} ({k} of {n} layers)"


def _rope(spec) -> str:
    if spec.rope_style == "none":
        return "none"
    part = "" if spec.rope_dim == spec.head_dim else f", {spec.rope_dim} of {spec.head_dim} dims"
    scaling = "" if spec.rope_scaling == "none" else f", {spec.rope_scaling}"
    out = f"{spec.rope_style}{part}, θ {spec.rope_theta:.0f}{scaling}"
    if spec.sliding_rope_theta is not None:
        s = "" if spec.sliding_rope_scaling == "none" else f" {spec.sliding_rope_scaling}"
        out += f"; sliding layers θ {spec.sliding_rope_theta:.0f}{s}"
    return out


def rows() -> list[tuple[str, object, object]]:
    """(config file stem, raw model_type, spec) per shipped config, sorted."""
    import json

    from flintgen import spec_from_hf_config

    out = []
    for path in sorted(glob.glob(os.path.join(CONFIGS, "*.json"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            mt = json.load(f).get("model_type")
        out.append((stem, mt, spec_from_hf_config(path, name=stem)))
    return out


def table() -> str:
    head = ("| config.json | model_type | q / kv heads | head dim | GQA per rank at TP " + " / ".join(map(str, TPS))
            + " | sliding window | sinks | soft-cap | q/k norm | bias | norm (1 + w) | RoPE |")
    lines = [head, "|" + "---|" * 13]
    for stem, mt, s in rows():
        lines.append(" | ".join([
            f"| {stem}", mt, f"{s.num_q_heads} / {s.num_kv_heads}", str(s.head_dim),
            " / ".join(_gqa_per_rank(s, tp) for tp in TPS), _window(s), "yes" if s.sinks else "—",
            "yes" if s.attn_logit_softcap else "—", "yes" if s.qk_norm else "—", "yes" if s.qkv_bias else "—",
            "yes" if s.norm_weight_offset else "—", _rope(s)]) + " |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The table between the markers of a README's text."""
    i, j = text.index(START) + len(START), text.index(END)
    return text[i:j].strip("\n")


def write() -> None:
    with open(README) as f:
        text = f.read()
    i, j = text.index(START) + len(START), text.index(END)
    with open(README, "w") as f:
        f.write(text[:i] + "\n" + table() + "\n" + text[j:])


if __name__ == "__main__":
    write() if "--write" in sys.argv[1:] else print(table())
