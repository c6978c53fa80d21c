"""Accept ``method: "ddtree"`` in ``--speculative-config``.

vLLM's ``SpeculativeConfig`` is a pydantic dataclass with ``extra="forbid"``
and a closed list of methods, and vLLM has no registry for new methods. We
wrap ``EngineArgs.create_speculative_config`` (it runs in the front-end
process, after plugins are loaded and before any engine process starts):
a ``ddtree`` config is validated by :class:`vllm_ddtree.core.config.DDTreeConfig`,
built as ``dflash`` and tagged with ``speculative_config.ddtree``.
Everything else passes through untouched.

It is also where DDTree configures the rest of the engine, because it runs
before vLLM builds the attention, scheduler and parallel configs:

* targets and engine settings DDTree cannot serve correctly are refused here
  (an fp8 KV cache is served on CPU where vLLM's CPU attention serves it, and
  on CUDA in the e4m3 format, :func:`check_quantized_kv_cache`),
  with an error that names the setting and the alternative
  (:func:`check_engine_args`); hybrid Gated DeltaNet targets get prefix
  caching off and a check that one request's states fit the cache
  (:func:`check_hybrid_target`);
* on CUDA the target's attention backend becomes ``DDTREE``
  (:func:`select_target_backend`); the drafter keeps a backend vLLM selects
  for DFlash's non-causal block, because vLLM builds the drafter's config
  with ``speculative_config.attention_backend`` (None: automatic);
* scheduling is synchronous and the model runner is V1.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.logger import init_logger

from vllm_ddtree.core.config import (
    METHOD,
    DDTreeConfig,
    DDTreeConfigError,
    read_drafter_config,
    resolve,
)
from vllm_ddtree.attention import (
    CUDA_BACKEND_NAME,
    CUDA_FP8_KV_CACHE_DTYPES,
    UNQUANTIZED_TREE_KV_CACHE_DTYPES,
)
from vllm_ddtree.kernels.fp8 import KV_CACHE_DTYPE_KINDS
from vllm_ddtree.patches.base import ALL_PLATFORMS, Patch
from vllm_ddtree.core.stats import new_stats_dir


logger = init_logger("vllm.ddtree")

_DFLASH = "Use method 'dflash' (the DFlash chain) for this setup."

# Any multiple of 32 (what CPU_ATTN takes): it only picks among the ISAs,
# fp8 support depends on the CPU and the head size.
_CPU_ISA_PROBE_BLOCK = 32


def _asks_for_ddtree(args: Any) -> bool:
    """Whether these engine args ask for DDTree (without normalising them)."""
    spec = args.speculative_config
    return args.spec_method == METHOD or (isinstance(spec, dict)
                                          and spec.get("method") == METHOD)


def _user_dict(args: Any) -> dict[str, Any] | None:
    spec = args.speculative_config
    if args.spec_method == METHOD:
        spec = dict(spec or {}, method=METHOD)
        args.spec_method = None
    if isinstance(spec, dict) and spec.get("method") == METHOD:
        return {k.replace("-", "_"): v for k, v in spec.items()}
    return None


def _refuse(setting: str, reason: str, fix: str) -> DDTreeConfigError:
    return DDTreeConfigError(f"{setting}: {reason}. {fix}")


# Targets whose non-attention layers are vLLM's Qwen Gated DeltaNet layers
# (QwenGatedDeltaNetAttention), which DDTree verifies per tree node.
GDN_ARCHITECTURES = frozenset({
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM",
})


def gdn_state_bytes(text_config: Any, budget: int, conv_bytes: int, ssm_bytes: int) -> int:
    """One request's Gated DeltaNet state at tree budget ``budget``: vLLM
    reserves ``1 + budget`` state blocks per GDN layer, each with a conv
    buffer of ``W - 1 + budget`` columns and one recurrent state."""
    from vllm_ddtree.gdn import state_bytes_per_request

    t = text_config
    layers = sum(1 for kind in t.layer_types if kind == "linear_attention")
    nk, nv = t.linear_num_key_heads, t.linear_num_value_heads
    dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
    return state_bytes_per_request(layers, 2 * nk * dk + nv * dv, t.linear_conv_kernel_dim,
                                   nv, dk, dv, budget, conv_bytes, ssm_bytes)


def _dtype_bytes(setting: str, model_dtype: Any) -> int:
    import torch

    if setting in (None, "auto"):
        return torch.empty((), dtype=model_dtype).element_size()
    return torch.empty((), dtype=getattr(torch, setting)).element_size()


def check_hybrid_target(args: Any, model_config: Any, budget: int, is_cpu: bool) -> None:
    """A hybrid Gated DeltaNet target: what DDTree can serve, and its state cost."""
    dflash = "Use method 'dflash' (the DFlash chain) for this model."
    archs = list(model_config.architectures or ())
    if not archs or not set(archs) <= GDN_ARCHITECTURES:
        raise _refuse("model", f"the target {archs} has non-attention layers (e.g. Mamba) that "
                      f"are not Qwen Gated DeltaNet layers, whose state DDTree cannot verify per "
                      f"tree node", dflash)
    if args.enable_prefix_caching or args.mamba_cache_mode == "align":
        # (left to its default, prefix caching is already off: PREFIX_CACHING_DEFAULT)
        flag = ("enable_prefix_caching" if args.enable_prefix_caching else "mamba_cache_mode")
        raise _refuse(flag, "on hybrid targets prefix caching needs vLLM's 'align' mamba cache "
                      "mode, whose per-step state copies follow the chain's accepted count, not "
                      "DDTree's committed column", "Serve with --no-enable-prefix-caching "
                      f"(and --mamba-cache-mode none). {dflash}")
    text = model_config.hf_text_config
    conv_b = _dtype_bytes(args.mamba_cache_dtype, model_config.dtype)
    ssm_b = _dtype_bytes(args.mamba_ssm_cache_dtype, model_config.dtype)
    need = gdn_state_bytes(text, budget, conv_b, ssm_b)
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if is_cpu and space.strip().isdigit() and int(space) > 0:
        have = int(space) * 2**30
        if need > have:
            fits = max((b for b in range(1, budget) if gdn_state_bytes(text, b, conv_b, ssm_b)
                        <= have), default=0)
            raise _refuse("num_speculative_tokens", f"at tree budget {budget} one request's "
                          f"Gated DeltaNet states take {need / 2**30:.2f} GiB "
                          f"({1 + budget} state slots in each GDN layer), more than the "
                          f"{have / 2**30:.0f} GiB KV cache (VLLM_CPU_KVCACHE_SPACE={space})",
                          f"Use num_speculative_tokens <= {fits}"
                          if fits else "Raise VLLM_CPU_KVCACHE_SPACE")


def check_engine_args(args: Any, model_config: Any, parallel_config: Any,
                      budget: int = 0, drafter_head_size: int | None = None) -> None:
    """Refuse, before any engine process starts, what DDTree would serve wrongly.
    ``drafter_head_size``: the drafter's, whose layers share the KV cache dtype."""
    from vllm.platforms import current_platform

    if parallel_config.pipeline_parallel_size > 1:
        raise _refuse("pipeline_parallel_size",
                      f"DDTree does not support pipeline parallelism (got "
                      f"{parallel_config.pipeline_parallel_size}): only the last stage has the "
                      f"logits and walks the tree, while every stage holds KV (and GDN "
                      f"states) of its own layers that the accepted path must compact, and "
                      f"vLLM sends earlier stages no per-step data after the forward",
                      f"Serve with --pipeline-parallel-size 1 and split the model with "
                      f"--tensor-parallel-size instead. {_DFLASH}")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel_config, name) > 1:
            raise _refuse(name, "DDTree does not support context parallelism",
                          f"Leave {name} at 1. {_DFLASH}")
    if model_config.is_attention_free:
        raise _refuse("model", "the target has no attention layers, so no tree can be "
                      "verified on it", _DFLASH)
    if getattr(model_config, "use_mla", False):
        raise _refuse("model", "the target uses multi-head latent attention (MLA, "
                      "DeepSeek-style: DeepSeek V2/V3, Kimi K2), which DDTree's tree attention "
                      "does not implement", _DFLASH)
    if getattr(model_config, "is_encoder_decoder", False):
        raise _refuse("model", "the target is an encoder-decoder model; DDTree verifies "
                      "trees in decoder self-attention only", _DFLASH)
    if model_config.is_hybrid:
        check_hybrid_target(args, model_config, budget, current_platform.is_cpu())
    mm = model_config.multimodal_config
    if mm is not None and not mm.language_model_only:
        # Tree nodes are text tokens and their M-RoPE rows are p0 + depth, but
        # DDTree's drafter conditioning and tree walk are only proven on text
        # requests: serve the model text-only, so that vLLM answers a request
        # with image or video inputs with its own 400 ("At most 0 ...").
        mm.language_model_only = True
        logger.warning("DDTree: %s is served text-only (--language-model-only): requests "
                       "with image or video inputs are refused. Use method 'dflash' for "
                       "multimodal requests.", model_config.model)
    text = model_config.hf_text_config
    if getattr(text, "attn_logit_softcapping", None):
        raise _refuse("model", "the target soft-caps attention logits, which the tree "
                      "attention kernel does not implement", _DFLASH)
    if model_config.uses_alibi:
        raise _refuse("model", "the target uses ALiBi, which the tree attention kernel does "
                      "not implement", _DFLASH)
    if args.kv_cache_dtype not in UNQUANTIZED_TREE_KV_CACHE_DTYPES:
        check_quantized_kv_cache(args.kv_cache_dtype, model_config, current_platform,
                                 drafter_head_size)
    if args.async_scheduling:
        raise _refuse("async_scheduling", "DDTree needs the tree of step N on the runner "
                      "before step N is scheduled",
                      "Drop --async-scheduling (DDTree turns it off by itself).")


def check_quantized_kv_cache(kv_cache_dtype: str, model_config: Any, platform: Any,
                             drafter_head_size: int | None = None) -> None:
    """A quantized KV cache: the per-tensor fp8 formats on CPU, where vLLM's
    own CPU attention serves them for the target and the drafter (x86 with
    AVX-512 or AMX, head sizes multiples of 32: vLLM's ``_get_attn_isa``);
    on CUDA the e4m3 one, the format vLLM's Triton backend reads; refused
    otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_KINDS:
        raise _refuse("kv_cache_dtype", f"DDTree reads unquantized KV caches and the "
                      f"per-tensor fp8 formats {sorted(KV_CACHE_DTYPE_KINDS)} only (got "
                      f"{kv_cache_dtype!r})", f"Use --kv-cache-dtype auto or fp8. {_DFLASH}")
    if platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        heads = {"target": model_config.get_head_size(), "drafter": drafter_head_size}
        for model, head_size in heads.items():
            if head_size is None:
                continue
            try:
                _get_attn_isa(model_config.dtype, _CPU_ISA_PROBE_BLOCK, head_size,
                              kv_cache_dtype)
            except NotImplementedError as e:
                raise _refuse("kv_cache_dtype", f"vLLM's CPU attention cannot keep a "
                              f"{kv_cache_dtype!r} KV cache for the {model} (head size "
                              f"{head_size}) here: {e}", "Use --kv-cache-dtype auto.") from None
        return
    if platform.is_cuda():
        if kv_cache_dtype in CUDA_FP8_KV_CACHE_DTYPES:
            if not platform.has_device_capability(89):
                # vLLM's Triton backend raises the same when the model loads
                raise _refuse("kv_cache_dtype", f"{kv_cache_dtype!r}: vLLM's Triton "
                              f"attention backend keeps fp8 KV caches on compute capability "
                              f"8.9 and newer only", "Use --kv-cache-dtype auto.")
            return
        raise _refuse("kv_cache_dtype", f"{kv_cache_dtype!r} on CUDA: vLLM's Triton attention "
                      f"backend, which DDTree's extends, reads every fp8 cache as e4m3",
                      f"Use --kv-cache-dtype fp8 (e4m3) or auto. {_DFLASH}")
    raise _refuse("kv_cache_dtype", f"DDTree serves an fp8 KV cache on CPU and CUDA only, not "
                  f"on the {platform.device_name} platform",
                  f"Use --kv-cache-dtype auto. {_DFLASH}")


def _backend_name(value: Any) -> str | None:
    if value is None:
        return None
    name = value.name if hasattr(value, "name") else str(value).upper()
    return None if name == "AUTO" else name


def select_target_backend(args: Any, is_cuda: bool) -> None:
    """On CUDA, give the target's attention layers the ``DDTREE`` backend.

    vLLM's CUDA selector would otherwise pick FLASH_ATTN or FLASHINFER, which
    ignore the tree mask. A user's ``--attention-backend`` (or
    ``attention_config.backend`` / ``backend_per_kind``) other than DDTREE is
    refused. On CPU vLLM always uses CPU_ATTN, which the plugin overrides.
    """
    if not is_cuda:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    chosen = {"--attention-backend": _backend_name(args.attention_backend),
              "attention_config.backend": _backend_name(args.attention_config.backend)}
    chosen.update({f"attention_config.backend_per_kind[{kind!r}]": _backend_name(v)
                   for kind, v in args.attention_config.backend_per_kind.items()})
    for flag, name in chosen.items():
        if name is not None and name != CUDA_BACKEND_NAME:
            raise _refuse(flag, f"DDTree verifies trees with its own attention backend "
                          f"{CUDA_BACKEND_NAME}; {name} would ignore the tree mask and "
                          f"produce wrong tokens",
                          f"Drop {flag} (DDTree selects {CUDA_BACKEND_NAME} for the target "
                          f"by itself), or use method 'dflash' to keep {name}.")
    if CUDA_BACKEND_NAME not in AttentionBackendEnum.__members__:
        raise RuntimeError(f"DDTree: the {CUDA_BACKEND_NAME} attention backend is not "
                           f"registered; the plugin's register() did not run in this process")
    if chosen["attention_config.backend"] is None:
        args.attention_backend = AttentionBackendEnum[CUDA_BACKEND_NAME]


def drafter_head_size(draft_config: dict[str, Any]) -> int | None:
    """The head size in a drafter's raw config (``head_dim``, else hidden size
    over heads); None when it does not say."""
    head = draft_config.get("head_dim")
    if isinstance(head, int):
        return head
    hidden, heads = draft_config.get("hidden_size"), draft_config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _configure_engine(args: Any, model_config: Any, parallel_config: Any,
                      budget: int, draft_config: dict[str, Any]) -> None:
    """Engine-wide settings that DDTree needs (documented in docs/design.md)."""
    from vllm.platforms import current_platform

    check_engine_args(args, model_config, parallel_config, budget,
                      drafter_head_size(draft_config))
    select_target_backend(args, current_platform.is_cuda())
    args.async_scheduling = False
    # The tree seams live in the V1 model runner (vLLM picks V2 on CUDA by default).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def _find_drafter(target: str) -> str:
    """The drafter for ``{"method": "ddtree"}`` without a model (vllm_ddtree/drafters.py)."""
    from vllm_ddtree.drafters import DrafterNotFound, find_drafter

    try:
        drafter = find_drafter(target)
    except DrafterNotFound as e:
        raise DDTreeConfigError(str(e)) from None
    logger.info("DDTree: drafter %s for the target %s: %s", drafter.model, target, drafter.why)
    return drafter.model


# vLLM's SpeculativeConfig field that stops the scheduler from dropping the
# last matched prefix-cache block for EAGLE-style drafters (DFlash included).
_BLOCK_DROP_FIELD = "disable_eagle_block_drop"


def keep_trailing_cached_block(vllm_dict: dict[str, Any], prefix_caching: bool | None) -> None:
    """Keep the whole prefix-cache hit (``disable_eagle_block_drop``) unless
    the user set it.

    vLLM drops the last matched block of every prefix-cache hit for EAGLE-style
    methods, DFlash among them: an EAGLE drafter's K/V at a position is built
    from the *next* token too, so the trailing block of a cached prefix may
    hold drafter K/V made before that token was known. A DFlash drafter's
    context K/V at a position is a function of the target's hidden states
    there and the position alone, and DDTree stores it for every token the
    target computes before the drafter next reads its cache (plain steps
    included: ``DDTreeRunnerMixin._ddtree_store_pending_context``), so every
    full cached block carries it whole. The dropped block costs a re-prefill
    of up to one block per request on every hit: on the bundled pair at 64
    requests with prefix caching, a fifth of a plain-mode round's time.
    """
    from vllm.config.speculative import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    if _BLOCK_DROP_FIELD not in fields or _BLOCK_DROP_FIELD in vllm_dict:
        return  # this vLLM has no such switch, or the user chose
    vllm_dict[_BLOCK_DROP_FIELD] = True
    if prefix_caching is not False:
        logger.info("DDTree: prefix-cache hits keep their last block (%s=True): a DFlash "
                    "drafter's context K/V of a token depends on that token's target hidden "
                    "states and position only, so vLLM's warning that this may affect "
                    "acceptance does not apply to DDTree.", _BLOCK_DROP_FIELD)


# Set on the EngineArgs by create_speculative_config: the drafter's query rows
# per request in one drafting step (the bonus token and every drafted position).
_ROWS_ATTR = "_ddtree_drafter_rows"


def fit_drafter_rows(args: Any, rows: int, user_tokens: int | None,
                     user_seqs: int | None) -> None:
    """Make ``max_num_batched_tokens`` hold a drafting step of ``max_num_seqs``
    requests, ``rows`` drafter queries each; ``user_tokens`` / ``user_seqs``
    are the values the user set (None: vLLM's default).

    DFlash sizes the drafter's token buffers (``input_ids``) and vLLM its
    compiled shape ranges by ``max_num_batched_tokens``, yet one drafting step
    has ``rows`` queries per request whatever each request was scheduled: a
    batch of one-token steps (decodes, a prefill after a whole prefix-cache
    hit) drafts ``max_num_seqs * rows`` rows. Past the buffer, vLLM's CPU
    kernel writes out of bounds (heap corruption) and the CUDA kernel out of
    its allocation. A default is moved to fit, the token budget first; values
    the user set both are refused when they do not fit.
    """
    tokens, seqs = args.max_num_batched_tokens, args.max_num_seqs
    need = seqs * rows
    if need <= tokens:
        return
    why = (f"one DDTree drafting step has {rows} drafter query rows per request (the bonus "
           f"token and {rows - 1} drafted positions), {need} at max_num_seqs={seqs}, more "
           f"than max_num_batched_tokens={tokens}, which sizes the drafter's token buffers "
           f"and compiled shapes")
    if user_tokens is None:
        args.max_num_batched_tokens = need
        logger.info("DDTree: max_num_batched_tokens %d -> %d: %s.", tokens, need, why)
    elif user_seqs is None and tokens >= rows:
        args.max_num_seqs = tokens // rows
        logger.warning("DDTree: max_num_seqs %d -> %d: %s. Set --max-num-batched-tokens >= %d "
                       "to keep %d.", seqs, args.max_num_seqs, why, need, seqs)
    else:
        fix = (f"Use --max-num-batched-tokens >= {need}"
               + (f" or --max-num-seqs <= {tokens // rows}" if tokens >= rows else ""))
        raise _refuse("max_num_batched_tokens", why, fix)


def _build(original):
    def create_speculative_config(self, target_model_config, target_parallel_config):
        user = _user_dict(self)
        if user is None:
            return original(self, target_model_config, target_parallel_config)
        if not user.get("model"):
            user["model"] = _find_drafter(target_model_config.model)
        cfg, vllm_dict = DDTreeConfig.from_speculative_dict(user)
        # Check the drafter before vLLM does, so a wrong model gets our message.
        draft_config = read_drafter_config(vllm_dict["model"], vllm_dict.get("revision"))
        runtime = resolve(cfg, draft_config)
        _configure_engine(self, target_model_config, target_parallel_config, runtime.budget,
                          draft_config)
        keep_trailing_cached_block(vllm_dict, self.enable_prefix_caching)
        setattr(self, _ROWS_ATTR, 1 + runtime.depth)  # read by BATCH_DEFAULTS
        self.speculative_config = vllm_dict
        spec = original(self, target_model_config, target_parallel_config)
        # Post-construction attributes are not validated by pydantic and survive
        # pickling to the engine and worker processes.
        spec.ddtree = runtime.model_copy(update={"stats_dir": new_stats_dir()})
        return spec

    create_speculative_config.__wrapped__ = original
    return create_speculative_config


PATCH = Patch(
    name="spec-config-ddtree-method",
    target="vllm.engine.arg_utils:EngineArgs.create_speculative_config",
    why="SpeculativeConfig forbids unknown methods/keys and has no method registry.",
    upstream="none: vLLM has no plugin hook for new speculative methods",
    vllm_versions=ALL_PLATFORMS,
    build=_build,
)



def _build_prefix_default(original):
    def _set_default_chunked_prefill_and_prefix_caching_args(self, model_config):
        if (self.enable_prefix_caching is None and model_config.is_hybrid
                and _asks_for_ddtree(self)):
            # Left to vLLM, prefix caching would be on, in the 'align' mamba cache
            # mode, which DDTree cannot serve on hybrids; asked for, it is refused
            # (check_hybrid_target).
            self.enable_prefix_caching = False
            logger.info("DDTree: prefix caching is off for the hybrid target %s (its "
                        "'align' mamba cache mode follows the chain's bookkeeping)",
                        model_config.model)
        return original(self, model_config)

    return _set_default_chunked_prefill_and_prefix_caching_args


PREFIX_CACHING_DEFAULT = Patch(
    name="hybrid-prefix-caching-default",
    target="vllm.engine.arg_utils:EngineArgs._set_default_chunked_prefill_and_prefix_caching_args",
    why="Turn prefix caching off by default for DDTree on hybrid targets, before vLLM builds "
        "the cache config (create_speculative_config runs after it); an explicit "
        "--enable-prefix-caching is refused instead.",
    upstream="vLLM has no per-speculative-method default for prefix caching",
    vllm_versions=ALL_PLATFORMS,
    build=_build_prefix_default,
)


def _build_batch_defaults(original):
    def _set_default_max_num_seqs_and_batched_tokens_args(self, usage_context, model_config,
                                                          parallel_config):
        user_tokens, user_seqs = self.max_num_batched_tokens, self.max_num_seqs
        out = original(self, usage_context, model_config, parallel_config)
        rows = getattr(self, _ROWS_ATTR, None)
        if rows is not None:
            fit_drafter_rows(self, rows, user_tokens, user_seqs)
        return out

    return _set_default_max_num_seqs_and_batched_tokens_args


BATCH_DEFAULTS = Patch(
    name="ddtree-batch-defaults",
    target="vllm.engine.arg_utils:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
    why="A DFlash drafting step has 1 + depth query rows per request, but vLLM sizes the "
        "drafter's input_ids buffer and the compiled shape ranges by max_num_batched_tokens "
        "(its defaults are set after create_speculative_config): max_num_seqs one-token "
        "requests overran it, and vLLM's CPU kernel corrupted the heap. The defaults are "
        "moved to fit (fit_drafter_rows); explicit values that do not fit are refused.",
    upstream="open upstream (vllm-project/vllm#53970 raises the default for DFlash)",
    vllm_versions=ALL_PLATFORMS,
    build=_build_batch_defaults,
)


def _build_drafting_slots(original):
    def max_num_new_slots_for_drafting(self) -> int:
        if getattr(self, "ddtree", None) is not None:
            return 0
        return original.fget(self)

    return property(max_num_new_slots_for_drafting, doc=original.__doc__)


DRAFTING_SLOTS = Patch(
    name="ddtree-drafting-slots",
    target="vllm.config.speculative:SpeculativeConfig.max_num_new_slots_for_drafting",
    why="vLLM 0.32 reserves num_speculative_tokens scheduler slots per request for a DFlash "
        "drafter's queries. Those queries run in the drafter's own pass with its own buffers "
        "(vLLM 0.33 reserves none for DFlash, with dflash.py unchanged), and for DDTree "
        "num_speculative_tokens is the tree budget: at B = 64 every request took 65 slots of "
        "the 4096 a step has, so at most 63 requests decoded per step even in plain steps, "
        "and prefills were admitted a trickle at a time.",
    upstream="fixed in vLLM 0.33 (returns 0 for DFlash); this patch makes 0.32 agree for ddtree",
    vllm_versions=ALL_PLATFORMS,
    build=_build_drafting_slots,
)
