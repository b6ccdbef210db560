"""Build every kernel variant into a scratch cache, then compare two such
caches variant by variant: the cubin embedded in each kernel.so (the SASS
that runs), and the PTX. For refactors that must not change the device code.

    # before the change (a checkout of the old commit), then after it:
    PYTHONPATH=. python tools/sass_diff.py build /tmp/sass-base [--set extended]
    PYTHONPATH=. python tools/sass_diff.py build /tmp/sass-new  [--set extended]
    python tools/sass_diff.py compare /tmp/sass-base /tmp/sass-new [--nvdisasm PATH]

``build`` compiles for Target("sm_90a", 132) through flintgen's own cache
(cache.make_entry / get_or_build), one process: ``presets`` is every
variant of every preset (``flintgen build --preset X --arch sm_90a
--num-sms 132`` for each); ``extended`` adds shapes no preset has (GQA 4 /
16 at head_dim 64 and 128, pages of 32 / 64, one kv head per rank, the
several-CTA merges) and the QKV debug binaries; ``stream`` is the streaming
QKV design's binaries alone (max_tokens 64: its tiles, launch options and
debug binaries; ``_stream_plan``).

``compare`` pairs cache entries by variant name (entry directories are
``<variant name>-<key16>``). The cache key hash is part of the kernel's
symbol (the generated module's name) and of the host function name, so
every occurrence of the entry's key (its first 16 and 12 hex digits) is
replaced by a fixed string of the same length before comparing; nothing
else is normalized. The cubin is the ELF image embedded in kernel.so
(after the host library's own ELF header); identical normalized cubins
mean identical SASS, register counts and shared-memory sizes. With
``--nvdisasm`` (e.g. from the ``nvidia-cuda-nvdisasm`` wheel) a differing
cubin's SASS diff is printed. Exit status 0 only when every variant of the
base has an identical cubin in the new cache and no variant is missing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import struct
import subprocess
import sys
import tempfile

ARCH, NUM_SMS = "sm_90a", 132
_ELF = b"\x7fELF"


# ----------------------------------------------------------------- build
def _extended_specs():
    """Specs that reach code paths the presets do not (named for reading)."""
    from flintgen.presets import FLINT, GPT_OSS_20B

    small = dict(max_batch=16)
    return [
        # 16/2 heads: B=1 has 66 splits, 4 mergers from 40 active splits.
        FLINT.replace(name="flint-tp2", tp_size=2),
        FLINT.replace(name="flint-page32", page_size=32, **small),
        FLINT.replace(name="flint-page64", page_size=64, **small),
        # GQA 16, head_dim 128: two head tiles, 4 mergers at <= 8 pairs.
        FLINT.replace(name="gqa16-d128", num_q_heads=64, max_batch=64),
        FLINT.replace(name="gqa16-d128-page64", num_q_heads=64, page_size=64, **small),
        # GQA 16 / 4 at head_dim 64; one kv head per rank (gpt-oss at TP 8).
        GPT_OSS_20B.replace(name="gqa16-d64", num_q_heads=128, max_batch=32),
        GPT_OSS_20B.replace(name="gqa4-d64-page32", num_kv_heads=16, page_size=32, **small),
        GPT_OSS_20B.replace(name="gpt-oss-tp8", tp_size=8, **small),
        GPT_OSS_20B.replace(name="gpt-oss-nvfp4", weight_format="nvfp4", max_batch=1),
    ]


def _stream_plan(target):
    """The streaming QKV design's binaries (``--set stream``): the op's tiles of 16-64 tokens and their debug
    binaries for flint BF16 (hidden 2048), hidden 4096 32/8, an e4m3 cache, head_dim 64 / 96, and the launch
    options no tile selects (register path, TMA ring, L2 prefetch, spread finish at 16 tokens)."""
    from flintgen.configs.qkv_stream_plan import StreamConfig
    from flintgen.kernels import KERNELS
    from flintgen.presets import FLINT, GPT_OSS_20B

    bf16 = FLINT.replace(name="flint-bf16-64", weight_format="bf16", max_tokens=64)
    specs = [bf16, bf16.replace(name="h4096-64", hidden_size=4096, num_kv_heads=8, sliding_window=None,
                                layer_types=("full",), sinks=False),
             bf16.replace(name="flint-bf16-64-fp8", kv_cache_dtype="fp8_e4m3"),
             GPT_OSS_20B.replace(name="gpt-oss-bf16-64", weight_format="bf16", max_tokens=64),
             bf16.replace(name="flint-d96-64", head_dim=96)]
    configs = [None, StreamConfig(prefetch=2), StreamConfig(stages=8, wgmma=True, tma=True),
               StreamConfig(stages=6, wgmma=True, l2_prefetch=8), StreamConfig(stages=8, wgmma=True, finish_tokens=16)]
    kdef = KERNELS["qkv"]
    plan, seen = [], set()
    for spec in specs:
        for cfg in configs:
            for tile in (16, 32, 64):
                for debug in (False, True):
                    try:
                        v = kdef.variant(spec, debug=debug, config=cfg, max_m=tile, target=target)
                    except ValueError:   # an option the shape does not take (wgmma at head_dim 96)
                        continue
                    if dict(v.params).get("design") == "stream" and v.name not in seen:
                        seen.add(v.name)
                        plan.append((spec, kdef, v))
    return plan


def _plan(which: str):
    from flintgen.kernels import KERNELS
    from flintgen.kernels.base import Target
    from flintgen.presets import PRESETS

    target = Target(ARCH, NUM_SMS)
    if which == "stream":
        return _stream_plan(target), target
    specs = [PRESETS[n] for n in sorted(PRESETS)]
    if which == "extended":
        specs += _extended_specs()
    plan, seen = [], set()
    for spec in specs:
        for kdef in KERNELS.values():
            if not kdef.needed(spec):
                continue
            variants = list(kdef.variants(spec, target))
            if which == "extended" and kdef.name == "qkv":
                variants.append(kdef.variant(spec, debug=True, target=target))
            for v in variants:
                if v.name not in seen:  # equal names are one cache entry
                    seen.add(v.name)
                    plan.append((spec, kdef, v))
    return plan, target


def build(out: str, which: str, only: str | None = None) -> int:
    import re

    from flintgen import cache

    plan, target = _plan(which)
    if only:
        plan = [p for p in plan if re.search(only, p[2].name)]
    root = os.path.abspath(out)
    print(f"building {len(plan)} variants ({which}) for {target.arch} x {target.num_sms} SMs into {root}")
    failed = 0
    for i, (spec, kdef, v) in enumerate(plan, 1):
        entry = cache.make_entry(v, kdef.template_of(v), dict(kdef.render_params(spec, v)), target, root)
        try:
            outcome = cache.get_or_build(entry)
            print(f"[{i}/{len(plan)}] {'hit ' if outcome.hit else 'miss'} {v.name}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the others still build
            failed += 1
            print(f"[{i}/{len(plan)}] FAILED {v.name}: {e}", flush=True)
    return 1 if failed else 0


# ----------------------------------------------------------------- compare
def embedded_cubin(so: bytes) -> bytes:
    """The device ELF images inside a kernel.so (one per arch; one for
    sm_90a), concatenated: each ELF image after offset 0, cut at the end of
    its header tables or of its last section, whichever is later."""
    images, start = [], so.find(_ELF, 1)
    while start >= 0:
        img = _elf_image(so[start:])
        images.append(img)
        start = so.find(_ELF, start + len(img))
    if not images:
        raise ValueError("no embedded ELF image (cubin) in kernel.so")
    return b"".join(images)


def _elf_image(img: bytes) -> bytes:
    if img[4] != 2:
        raise ValueError("embedded cubin is not ELF64")
    e_phoff, e_shoff = struct.unpack_from("<QQ", img, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", img, 0x36)
    end = max(e_shoff + e_shentsize * e_shnum, e_phoff + e_phentsize * e_phnum)
    for i in range(e_shnum):
        sh = e_shoff + i * e_shentsize
        sh_type, = struct.unpack_from("<I", img, sh + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", img, sh + 0x18)
        if sh_type != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, sh_offset + sh_size)
    return img[:end]


def _normalize(data: bytes, key: str) -> bytes:
    for n in (16, 12):
        data = data.replace(key[:n].encode(), b"K" * n)
    return data


def _entries(root: str) -> dict[str, str]:
    """variant name -> entry directory, over every ``<arch>-<sms>sm`` folder."""
    out = {}
    for tdir in sorted(os.listdir(root)):
        tpath = os.path.join(root, tdir)
        if not os.path.isdir(tpath) or tdir == "locks":
            continue
        for name in sorted(os.listdir(tpath)):
            path = os.path.join(tpath, name)
            if os.path.isfile(os.path.join(path, "meta.json")):
                variant, _, _key16 = name.rpartition("-")
                out[f"{tdir}/{variant}"] = path
    return out


def _load(entry: str) -> tuple[bytes, str]:
    with open(os.path.join(entry, "meta.json")) as f:
        key = json.load(f)["key"]
    with open(os.path.join(entry, "kernel.so"), "rb") as f:
        cubin = _normalize(embedded_cubin(f.read()), key)
    with open(os.path.join(entry, "kernel.ptx"), "rb") as f:
        ptx = _normalize(f.read(), key).decode()
    return cubin, ptx


def _sass(cubin: bytes, nvdisasm: str) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([nvdisasm, "-c", "-hex", f.name], capture_output=True, text=True, check=True)
    return res.stdout.splitlines()


def compare(base: str, new: str, nvdisasm: str | None, show: int) -> int:
    a, b = _entries(base), _entries(new)
    missing = sorted(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    same = ptx_same = 0
    differ = []
    for name in sorted(set(a) & set(b)):
        ca, pa = _load(a[name])
        cb, pb = _load(b[name])
        ptx_same += pa == pb
        if ca == cb:
            same += 1
        else:
            differ.append(name)
            print(f"DIFFERENT cubin: {name} ({len(ca)} vs {len(cb)} bytes)")
            if nvdisasm:
                diff = list(difflib.unified_diff(_sass(ca, nvdisasm), _sass(cb, nvdisasm), lineterm="", n=2))
                print("\n".join(diff[:show]) or "  (SASS text identical: the difference is in metadata)")
    for name in missing:
        print(f"MISSING in {new}: {name}")
    for name in extra:
        print(f"only in {new}: {name}")
    print(f"{len(set(a) & set(b))} variants compared: {same} cubins identical, {len(differ)} different; "
          f"PTX identical for {ptx_same}; {len(missing)} missing, {len(extra)} new "
          "(key hash normalized)")
    return 0 if not differ and not missing else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile every variant into a scratch cache")
    b.add_argument("out")
    b.add_argument("--set", choices=("presets", "extended", "stream"), default="presets")
    b.add_argument("--only", default=None, help="only variants whose name matches this regex")
    c = sub.add_parser("compare", help="compare two scratch caches variant by variant")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--nvdisasm", default=None, help="nvdisasm binary: print SASS diffs of differing cubins")
    c.add_argument("--show", type=int, default=80, help="diff lines shown per differing variant")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build(args.out, args.set, args.only)
    return compare(args.base, args.new, args.nvdisasm, args.show)


if __name__ == "__main__":
    sys.exit(main())
