"""Sliding-window semantics of decode attention, against transformers' own code.

Semantic: ``window`` is the model's ``sliding_window`` in tokens, the current
token included. The decode token at position L-1 attends to positions
max(0, L - W) .. L-1 (W tokens), so ``op(..., window=config.sliding_window, ...)``
unchanged, with no +1 or -1, for gemma2 (4096), mistral v0.1 (4096) and phi3
(phi3-mini-4k: 2047, so 2047 tokens, not 2048).

How it was established (transformers 5.24 on the CPU machine, 5.17 on the GPU
machine; the code cited below is the same in both):

* ``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``.
  ``create_sliding_window_causal_mask`` builds it from ``config.sliding_window``.
  Gemma2Model builds it for its "sliding_attention" layers (``config.layer_types``).
  MistralModel and Phi3Model build it for every layer once ``config.sliding_window``
  is set. No model file adds or subtracts 1.
* ``cache_utils.DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1``
  tokens, so a decode step sees W keys. ``get_mask_sizes`` gives the offset.
* Not run here: ``modeling_flash_attention_utils`` passes flash-attn
  ``window_size = (sliding_window - 1, sliding_window - 1)``, which is also W
  tokens with the current one included.

The tests run the model itself: a one-layer Gemma2Model / MistralModel /
Phi3Model in fp32, with a prefill of L-1 tokens and then one decode step
through its DynamicCache. For eager they use each modeling file's
``eager_attention_forward``; for sdpa (mistral and phi3 only, since Gemma2
refuses sdpa) ``ALL_ATTENTION_FUNCTIONS["sdpa"]``. Each cache is run two ways:
the config's sliding cache, where the window comes from truncation plus an
offset mask, and a plain full cache, where only the mask limits it. A wrapper
around the attention function records q / k / v and the output. It rounds
q / k / v to bf16 values, as a bf16 KV cache would, so the kernel gets exactly
transformers' inputs. For eager, the positions that get a nonzero softmax
weight give the attended set directly. The decode output must match flintgen's
fp64 reference given the same q / k / v with ``window=sliding_window``. The
test also checks that the reference at W-1 and W+1 misses the tolerance,
so a one-token shift cannot pass. On the GPU (``gpu``), the flintgen kernel
for each model's per-rank shape runs one batch at W-1, W, W+1 and W+17 on
transformers' q / k / v.

Gemma2's attn_logit_softcapping is set to None: soft-capping is being added
separately. Scale: gemma2 ``query_pre_attn_scalar ** -0.5``, others ``head_dim ** -0.5``.
"""

import inspect
import random

import pytest
import torch

from flintgen.presets import FLINT
from flintgen.references.decode_attention import decode_attention_ref, rel_error

from decode_attention_cases import Case, record

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402

# model type -> (modeling module, base model class name, sliding_window, head_dim, attention implementations)
MODELS = {
    "gemma2": (modeling_gemma2, "Gemma2Model", 4096, 256, ("eager",)),   # Gemma2 refuses sdpa
    "mistral": (modeling_mistral, "MistralModel", 4096, 128, ("eager", "sdpa")),
    "phi3": (modeling_phi3, "Phi3Model", 2047, 96, ("eager", "sdpa")),
}
# fp32 transformers vs the fp64 reference on identical inputs: worst of 240 random runs 9.1e-7 (fp32 rounding of
# the logits, softmax and P @ V over up to 4096 keys), hence 1e-5. A one-token window shift moves the output by
# 3e-4 at the least in 300 runs (median 4e-3, about 1/sqrt(W)), so the shifted windows must fail it.
TOL = 1e-5


def hf_config(model, q_heads, kv_heads, *, hidden=64, layers=1, real=False):
    """transformers config for ``model``: its real sliding_window and head_dim, small elsewhere unless ``real``
    is set (real is used for the flintgen.hf mapping test)."""
    _, _, window, head_dim, _ = MODELS[model]
    kw = dict(num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
              sliding_window=window)
    if not real:
        kw.update(vocab_size=32, intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model == "gemma2":
        # query_pre_attn_scalar 144 is gemma2-27b's value. gemma2-9b uses 256 = head_dim, which would hide a
        # head_dim**-0.5 mixup.
        cfg = transformers.Gemma2Config(hidden_size=3584 if real else hidden, head_dim=head_dim,
                                        query_pre_attn_scalar=256 if real else 144,
                                        attn_logit_softcapping=None, final_logit_softcapping=None, **kw)
    elif model == "mistral":
        cfg = transformers.MistralConfig(hidden_size=4096 if real else hidden, head_dim=head_dim, **kw)
    else:   # Phi3 has no head_dim field: it is hidden_size // num_attention_heads
        cfg = transformers.Phi3Config(hidden_size=head_dim * q_heads, max_position_embeddings=4096,
                                      original_max_position_embeddings=4096, **kw)
    cfg.initializer_range = cfg.hidden_size ** -0.5   # q, k, v entries ~ N(0, 1): logits of std ~1
    return cfg


def tf_scale(model, cfg):
    return cfg.query_pre_attn_scalar ** -0.5 if model == "gemma2" else MODELS[model][3] ** -0.5


def build_model(model, cfg, impl, device="cpu"):
    mod, cls, *_ = MODELS[model]
    return getattr(mod, cls)._from_config(cfg, attn_implementation=impl).eval().to(device)


def decode_step(net, model, impl, cache_kind, length, device="cpu"):
    """Prefill ``length - 1`` random tokens, then decode one. Returns the decode step's q [Hq, D], the keys and
    values it saw [Hkv, n, D], softmax weights [Hq, n] (eager) or None, output [Hq, D], transformers' scaling,
    and the keys and values of all ``length`` positions [Hkv, L, D]."""
    mod = MODELS[model][0]
    calls = []

    def recorder(orig):
        def attention(module, query, key, value, attention_mask, **kw):
            query, key, value = (t.bfloat16().float() for t in (query, key, value))   # a bf16 cache's values
            out, weights = orig(module, query, key, value, attention_mask, **kw)
            calls.append((query, key, value, weights, out, kw.get("scaling")))
            return out, weights
        return attention

    cache = DynamicCache(config=net.config) if cache_kind == "sliding" else DynamicCache()
    name = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"  # 5.24 / 5.17
    x = torch.randn(1, length, net.config.hidden_size, device=device)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        if impl == "eager":   # what each model's attention falls back to for "eager"
            mp.setattr(mod, "eager_attention_forward", recorder(mod.eager_attention_forward))
        else:
            mp.setitem(ALL_ATTENTION_FUNCTIONS, impl, recorder(ALL_ATTENTION_FUNCTIONS[impl]))
        net(inputs_embeds=x[:, :-1], use_cache=True, **{name: cache})
        net(inputs_embeds=x[:, -1:], use_cache=True, **{name: cache})
    (_, pk, pv, _, _, _), (q, k, v, w, out, scaling) = calls[-2:]
    keys, values = torch.cat([pk, k[:, :, -1:]], 2)[0], torch.cat([pv, v[:, :, -1:]], 2)[0]
    # The decode step's keys are the last n positions (all of them with a full cache).
    assert torch.equal(k[0], keys[:, length - k.shape[2]:]) and torch.equal(v[0], values[:, length - v.shape[2]:])
    return dict(q=q[0, :, 0], k=k[0], w=None if w is None else w[0, :, 0], out=out[0, 0], scaling=scaling,
                keys=keys, values=values)


def paged(keys, values, page=16):
    """keys / values [Hkv, L, D] -> (kv_cache, block_tables, seq_lens) for one request, pages permuted, block 0
    unused (NaN)."""
    hkv, n, d = keys.shape
    pages = -(-n // page)
    kv = torch.full((pages + 1, hkv, page, 2 * d), float("nan"), dtype=torch.float64, device=keys.device)
    ids = torch.randperm(pages) + 1
    rows = torch.cat([keys, values], -1).double()
    rows = torch.nn.functional.pad(rows, (0, 0, 0, pages * page - n), value=float("nan"))
    kv[ids.to(keys.device)] = rows.view(hkv, pages, page, 2 * d).transpose(0, 1)
    return kv, ids.int().view(1, -1).to(keys.device), torch.tensor([n], dtype=torch.int32, device=keys.device)


def ref_out(run, window, scale):
    """flintgen's fp64 reference for the decode token, given every position's k / v."""
    return decode_attention_ref(run["q"][None].double(), *paged(run["keys"], run["values"]), None, window,
                                scale)[0]


def shifted_windows(length, window):
    """Windows one token off that attend to a different set at this length."""
    return [w for w in (window - 1, window + 1) if min(length, w) != min(length, window)]


def _cases():
    for model, (_, _, w, _, impls) in MODELS.items():
        for length in (w - 1, w, w + 1, w + 17):
            for impl in impls:
                for cache in ("sliding", "full"):
                    yield pytest.param(model, length, impl, cache, id=f"{model}-L{length}-{impl}-{cache}cache")


@pytest.mark.parametrize("model, length, impl, cache_kind", list(_cases()))
def test_transformers_attends_to_the_last_window_tokens(model, length, impl, cache_kind):
    seed = random.randrange(2 ** 31)   # fresh inputs each run, reported for a rerun
    torch.manual_seed(seed)
    cfg = hf_config(model, q_heads=4, kv_heads=2 if model != "phi3" else 4)
    window, scale = cfg.sliding_window, tf_scale(model, cfg)
    run = decode_step(build_model(model, cfg, impl), model, impl, cache_kind, length)
    tag = f"{model} L={length} {impl} {cache_kind} cache seed={seed}"
    assert run["scaling"] == pytest.approx(scale, rel=1e-12), tag
    expected = list(range(max(0, length - window), length))
    if run["w"] is not None:   # eager: the positions with a nonzero softmax weight, for every head
        n = run["k"].shape[1]
        for h, row in enumerate(run["w"]):
            assert [length - n + i for i in torch.nonzero(row > 0).flatten().tolist()] == expected, f"{tag} head {h}"
    err = rel_error(run["out"], ref_out(run, window, scale))
    shifted = {w: rel_error(run["out"], ref_out(run, w, scale)) for w in shifted_windows(length, window)}
    record(f"window {tag}: err vs reference(window={window}) {err:.2e}; "
           + ", ".join(f"vs window={w} {e:.2e}" for w, e in shifted.items()))
    assert err <= TOL, f"{tag}: {err:.3e} > {TOL}"
    for w, e in shifted.items():   # a one-token shift is outside the tolerance
        assert e > TOL, f"{tag}: window {w} would pass too ({e:.3e}): the tolerance is too loose"


_HF_REFUSED = pytest.mark.xfail(raises=ValueError, strict=False,
                                reason="flintgen.hf does not know model_type gemma2 / phi3 yet (another issue "
                                       "covers model types); then this passes as is")


@pytest.mark.parametrize("model, heads, layers", [
    pytest.param("gemma2", (16, 8), 42, marks=_HF_REFUSED),     # gemma2-9b
    ("mistral", (32, 8), 32),                                    # mistral-7b v0.1
    pytest.param("phi3", (32, 32), 32, marks=_HF_REFUSED),      # phi3-mini-4k
])
def test_hf_config_maps_sliding_window_unchanged(model, heads, layers):
    """spec.sliding_window must be config.sliding_window itself (the op's window, see the module docstring),
    on the layers where transformers builds the sliding mask."""
    from flintgen.hf import spec_from_hf_config

    cfg = hf_config(model, *heads, layers=layers, real=True)
    spec = spec_from_hf_config(cfg.to_dict())
    assert spec.sliding_window == cfg.sliding_window == MODELS[model][2]
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention"] * layers   # mistral / phi3: every layer
    assert spec.layer_types == tuple("sliding" if t == "sliding_attention" else "full" for t in kinds)
    assert spec.head_dim == MODELS[model][3]


# Per-rank shapes at TP 1 of gemma2-9b (16 q / 8 kv heads), mistral-7b v0.1 (32 / 8) and phi3-mini (32 / 32).
GPU_HEADS = {"gemma2": (16, 8), "mistral": (32, 8), "phi3": (32, 32)}


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_kernel_matches_transformers(model):
    """The kernel for the model's shape, with window = sliding_window, on one batch of requests at W-1, W, W+1
    and W+17. k / v / q come from transformers' decode steps (on the GPU). The cache is a Case: permuted pages,
    NaN outside every window (so a read of token L-W-1 shows up), and a poisoned out buffer. Each request must
    match transformers and lie on transformers' side, not the W-1 / W+1 side (see t below).
    One spec per model, so one kernel compile each."""
    import flintgen

    seed = random.randrange(2 ** 31)
    torch.manual_seed(seed)
    hq, hkv = GPU_HEADS[model]
    cfg = hf_config(model, hq, hkv)
    window, scale, d = cfg.sliding_window, tf_scale(model, cfg), MODELS[model][3]
    net = build_model(model, cfg, "eager", "cuda")
    lens = [window - 1, window, window + 1, window + 17]
    runs = [decode_step(net, model, "eager", "sliding", n, "cuda") for n in lens]
    # Built here, not at import, so that a Spec refusing a head dim fails only this test.
    spec = FLINT.replace(name=f"{model}-window", hidden_size=hq * d, num_q_heads=hq, num_kv_heads=hkv,
                         head_dim=d, sinks=False, qk_norm=False, sliding_window=window, layer_types=("sliding",),
                         softmax_scale=scale, max_batch=len(lens))
    case = Case(spec, lens, window, seed=seed)
    page = spec.page_size
    for i, (n, run) in enumerate(zip(lens, runs)):   # transformers' k / v over the window, q of the decode step
        pos = torch.arange(max(0, n - window), n, device="cuda")
        rows = torch.cat([run["keys"], run["values"]], -1)[:, pos].transpose(0, 1)   # [n, Hkv, 2D]
        case.kv[case.bt[i, pos // page].long(), :, pos % page] = rows.bfloat16()
        case.q[i] = run["q"].bfloat16()
    out = case.poisoned_out()
    flintgen.get_kernel(spec, "decode_attention")(*case.args(out))
    case.check(out, f"{spec.name} window={window} lens={lens} seed={seed}")   # vs fp64 ref on the same inputs
    for i, (n, run) in enumerate(zip(lens, runs)):
        got, want = out[i].double(), run["out"].double()
        err = rel_error(got, want)
        assert err <= 1e-2, f"{spec.name} L={n} seed={seed}: {err:.3e} vs transformers"
        # A one-token shift moves the output by about 1/sqrt(W), close to the kernel's bf16 error (an emulated
        # window-(W-1) kernel stayed at 2.4e-3 from transformers), so compare directions instead. t is where the
        # kernel's output sits on the line from transformers' output (t = 0) to the window-w output (t = 1). The
        # rounding noise is spread over Hq * D values: 0.015 at most in the CPU emulation, and +1.0 for the
        # window-(W-1) kernel.
        ts = {}
        for w in shifted_windows(n, window):
            delta = ref_out(run, w, scale) - want
            ts[w] = float(((got - want) * delta).sum() / (delta * delta).sum())
        record(f"{spec.name} L={n}: kernel vs transformers {err:.2e}; "
               + ", ".join(f"t(window={w}) {t:+.3f}" for w, t in ts.items()))
        for w, t in ts.items():
            assert abs(t) < 0.25, f"{spec.name} L={n} seed={seed}: output {t:.2f} of the way to window {w}'s"
