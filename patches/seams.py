"""Every vLLM name the plugin relies on, machine-readable.

This is the inventory behind ``patches/README.md`` (its "vLLM names" section
is generated from it: ``python scripts/seam_audit.py --write-readme``) and the
input of the seam audit (``patches/audit.py``, ``scripts/seam_audit.py``),
which checks every entry against a vLLM source tree without importing it.

A seam is a ``module:qualname`` (or, for ``op`` and ``env``, a bare name) and a
kind, which says what we do with it and therefore what the audit compares:

============  =============================================  ====================
kind          what the plugin does                           the audit compares
============  =============================================  ====================
patched       replaces it at run time (a ``Patch``)          signature + source
overridden    overrides it in a subclass, calling super      signature + source
subclassed    subclasses it                                  bases + source
signature     calls it with a fixed parameter list           signature + source
attribute     reads or writes it                             existence
imported      imports it                                     existence
op            calls vLLM's compiled op of that name          a Python caller
env           sets vLLM's environment variable               defined in envs.py
============  =============================================  ====================

``changes`` records, per vLLM minor line, how the plugin handles a seam whose
audit verdict there is not "unchanged" (a version switch, or why the change
does not matter). The audit tables in ``docs/seam_audit.md`` show both.

Nothing here imports vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("patched", "overridden", "subclassed", "signature", "attribute", "imported", "op",
         "env")


@dataclass(frozen=True)
class Seam:
    target: str
    kind: str
    area: str
    use: str
    changes: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    # The first vLLM minor line that has it ("0.33"); None: every supported line.
    since: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"seam {self.target}: kind {self.kind!r} is not one of {KINDS}")
        if self.area not in AREAS:
            raise ValueError(f"seam {self.target}: area {self.area!r} is not one of "
                             f"{sorted(AREAS)}")
        if self.kind not in ("op", "env") and ":" not in self.target:
            raise ValueError(f"seam {self.target}: target must be 'module:qualname'")

    @property
    def checks(self) -> str:
        return {"patched": "signature, source", "overridden": "signature, source",
                "subclassed": "bases, source", "signature": "signature, source",
                "attribute": "exists", "imported": "exists", "op": "a Python caller",
                "env": "defined"}[self.kind]

    @property
    def existence_only(self) -> bool:
        return self.kind in ("attribute", "imported", "op", "env")

    def expected_in(self, version: str) -> bool:
        """Whether vLLM ``version`` should have this seam at all."""
        if self.since is None:
            return True
        return _minor(version) >= _minor(self.since)


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# area -> (what for, what would replace these seams upstream)
AREAS: dict[str, tuple[str, str]] = {
    "config": ("`method: \"ddtree\"`, its refusals and the engine settings it needs",
               "a registry for speculative methods in vLLM"),
    "runner": ("the round: plan, masks, walk, compaction, drafter conditioning, the "
               "adaptive budget's clock", "runner hooks for per-step input rewrites, a "
               "pluggable verifier, a post-verification hook"),
    "proposer": ("the drafter's per-position logits and context-only steps",
                 "a draft-distribution hook and a context-only entry point on the proposer"),
    "sampler": ("every node's processed distribution and the output logprobs",
                "a per-row history hook in vLLM's sampler"),
    "structured output": ("grammar checks and bitmasks per tree node",
                          "tree-aware draft validation in vLLM"),
    "scheduler": ("the scheduled nodes of each request, the trees' parents",
                  "stable dataclass fields"),
    "attention": ("the tree mask in the attention backends, KV compaction in place",
                  "tree masks in vLLM's attention metadata and a tree-aware CPU op"),
    "GDN": ("hybrid Gated DeltaNet targets: per-node states and the commit",
            "a parent-aware GDN op in vLLM"),
    "metrics": ("the ddtree metrics on /metrics and the log line",
                "a conditional stat-logger hook"),
    "CPU fixes": ("vLLM CPU bugs the plugin works around", "the upstream fixes"),
}

_S = Seam
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_DFLASH = "vllm.v1.spec_decode.dflash:DFlashProposer"
_BASE_PROP = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
_SMD = "vllm.v1.sample.metadata:SamplingMetadata"
_BUILTIN = "vllm.v1.sample.logits_processor.builtin"
_SOM = "vllm.v1.structured_output:StructuredOutputManager"
_GRAMMAR = "vllm.v1.structured_output.backend_types:StructuredOutputGrammar"
_REQ = "vllm.v1.request:Request"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_TRITON = "vllm.v1.attention.backends.triton_attn"
_GDN_MD = "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata"
_GDN_MOD = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_GDN_LAYER = f"{_GDN_MOD}:QwenGatedDeltaNetAttention"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_DFLASH_MODEL = "vllm.model_executor.models.qwen3_dflash"

_PTR_RANGE_033 = ("bounds Triton's pointer ranges (`set_triton_ptr_range`, AMD's 32-bit "
                  "buffer addressing); DDTree's overrides call super for the stock path and "
                  "its tree kernel does not rely on it")
_BITMASK_033 = ("0.33+ gives every request a fixed block of `num_speculative_tokens + 1` "
                "rows and passes 4-tuples with the masked reasoning ends; "
                "`vllm_ddtree/structured.py` switches on `bitmask_layout()`")

SEAMS: list[Seam] = [
    # ------------------------------------------------------------------ config
    _S("vllm.engine.arg_utils:EngineArgs.create_speculative_config", "patched", "config",
       "accept `method: \"ddtree\"`, validate, refuse what DDTree cannot serve, build as "
       "`dflash`, attach `speculative_config.ddtree`"),
    _S("vllm.engine.arg_utils:EngineArgs._set_default_chunked_prefill_and_prefix_caching_args",
       "patched", "config", "prefix caching off by default on hybrid targets"),
    _S("vllm.engine.arg_utils:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
       "patched", "config", "defaults fitted so a drafting step's 1 + depth query rows per "
       "request fit the drafter's buffers"),
    _S("vllm.engine.arg_utils:EngineArgs.max_num_batched_tokens", "attribute", "config",
       "read; raised when left to vLLM's default"),
    _S("vllm.engine.arg_utils:EngineArgs.max_num_seqs", "attribute", "config",
       "read; lowered when left to vLLM's default and the token budget was set"),
    _S("vllm.engine.arg_utils:EngineArgs.enable_prefix_caching", "attribute", "config",
       "read: refused on hybrid targets"),
    _S("vllm.engine.arg_utils:EngineArgs.mamba_cache_mode", "attribute", "config",
       "read: `align` refused with DDTree"),
    _S("vllm.engine.arg_utils:EngineArgs.kv_cache_dtype", "attribute", "config",
       "read: fp8 served on CPU where vLLM's CPU attention serves it, e4m3 on CUDA, "
       "else refused"),
    _S(f"{_CPU_ATTN}:_get_attn_isa", "signature", "config",
       "an fp8 KV cache on CPU: refused before start where vLLM's CPU attention refuses it"),
    _S("vllm.config.model:ModelConfig.dtype", "attribute", "config",
       "the CPU attention ISA check for an fp8 KV cache"),
    _S("vllm.config.model:ModelConfig.get_head_size", "signature", "config",
       "the CPU attention ISA check for an fp8 KV cache"),
    _S("vllm.engine.arg_utils:EngineArgs.async_scheduling", "attribute", "config",
       "set to False"),
    _S("vllm.engine.arg_utils:EngineArgs.attention_backend", "attribute", "config",
       "set to `DDTREE` on CUDA"),
    _S("vllm.engine.arg_utils:EngineArgs.attention_config", "attribute", "config",
       "read: a user's backend choice is refused"),
    _S("vllm.engine.arg_utils:EngineArgs.speculative_config", "attribute", "config",
       "read and rewritten"),
    _S("vllm.config.speculative:SpeculativeConfig.num_speculative_tokens", "attribute",
       "config", "the tree budget B"),
    _S("vllm.config.speculative:SpeculativeConfig.rejection_sample_method", "attribute",
       "config", "refused unless `standard`: the tree walk replaces the rejection sampler",
       changes={"0.33": "adds the lossy `fly`; refused like every non-standard method"}),
    _S("vllm.config.speculative:SpeculativeConfig.disable_eagle_block_drop", "attribute",
       "config", "True for DDTree unless the user set it: prefix-cache hits keep their last "
       "block (a DFlash drafter's context K/V needs nothing past its token)"),
    _S("vllm.config.speculative:SpeculativeConfig.draft_sample_method", "attribute", "config",
       "refused unless the default: trees come from the drafter's distribution"),
    _S("vllm.config.speculative:SpeculativeConfig.max_num_new_slots_for_drafting",
       "patched", "config", "0 for DDTree: the drafter's queries run in their own pass "
       "(0.32 reserved the tree budget per request in every step's token budget)",
       changes={"0.33": "returns 0 for DFlash itself (dflash.py unchanged): the patch "
                        "returns the same for DDTree"}),
    _S("vllm.config.model:ModelConfig.is_hybrid", "attribute", "config",
       "hybrid targets: GDN checks"),
    _S("vllm.config.model:ModelConfig.is_attention_free", "attribute", "config", "refused"),
    _S("vllm.config.model:ModelConfig.uses_alibi", "attribute", "config", "refused"),
    _S("vllm.config.model:ModelConfig.use_mla", "attribute", "config",
       "refused at configuration (MLA)"),
    _S("vllm.config.model:ModelConfig.is_encoder_decoder", "attribute", "config",
       "refused at configuration"),
    _S("vllm.config.model:ModelConfig.hf_text_config", "attribute", "config",
       "GDN state size, soft-cap"),
    _S("vllm.config.model:ModelConfig.multimodal_config", "attribute", "config",
       "multimodal targets served text-only"),
    _S("vllm.config.model:ModelConfig.logprobs_mode", "attribute", "sampler",
       "which logprobs the walk reports"),
    _S("vllm.config.multimodal:MultiModalConfig.language_model_only", "attribute", "config",
       "set for multimodal targets"),
    _S("vllm.config.parallel:ParallelConfig.tensor_parallel_size", "attribute", "config",
       "TP > 1 refused"),
    _S("vllm.config.parallel:ParallelConfig.pipeline_parallel_size", "attribute", "config",
       "PP > 1 refused"),
    _S("vllm.config.parallel:ParallelConfig.decode_context_parallel_size", "attribute",
       "config", "CP > 1 refused"),
    _S("vllm.config.parallel:ParallelConfig.prefill_context_parallel_size", "attribute",
       "config", "CP > 1 refused"),
    _S("vllm.config.parallel:ParallelConfig.data_parallel_rank", "attribute", "metrics",
       "one counter file per engine"),
    _S("vllm.config.parallel:ParallelConfig.data_parallel_index", "attribute", "metrics",
       "the engine's counter file under data parallelism (data_parallel_rank is reset to 0 "
       "in each engine of a dense model)"),
    _S("vllm.config.parallel:ParallelConfig._api_process_rank", "attribute", "metrics",
       "only the first API server exports the ddtree counters"),
    _S("vllm.distributed.parallel_state:get_tp_group", "signature", "runner",
       "tensor parallelism: rank 0's decisions, the per-step agreement check"),
    _S("vllm.distributed.parallel_state:GroupCoordinator.broadcast_object", "signature",
       "runner", "rank 0's choice of drafting or not"),
    _S("vllm.distributed.parallel_state:GroupCoordinator.broadcast", "signature", "runner",
       "rank 0's per-request budgets"),
    _S("vllm.distributed.parallel_state:GroupCoordinator.all_gather", "signature", "runner",
       "every rank's walk fingerprint"),
    _S("vllm.distributed.parallel_state:GroupCoordinator.rank_in_group", "attribute",
       "runner", "rank 0 decides and counts"),
    _S("vllm.distributed.parallel_state:GroupCoordinator.world_size", "attribute", "runner",
       "tensor parallelism on or off"),
    _S("vllm.config:get_layers_from_vllm_config", "signature", "runner",
       "the target's attention and GDN layers"),
    _S("vllm.sampling_params:SamplingParams._validate_spec_decode", "patched", "config",
       "accept `min_p` and `logit_bias`, refuse what the walk does not honour"),
    _S("VLLM_USE_V2_MODEL_RUNNER", "env", "config",
       "set to 0: the seams live in the V1 runner"),
    _S("vllm.platforms:current_platform", "imported", "config", "the platform"),
    _S("vllm.config:VllmConfig", "imported", "proposer", "the proposer's config"),
    _S("vllm:LLM", "imported", "metrics", "`vllm-ddtree trace` runs the offline engine"),
    _S("vllm:SamplingParams", "imported", "metrics", "`vllm-ddtree trace` requests"),
    _S("vllm.platforms.interface:Platform.is_cpu", "signature", "config", "platform switch"),
    _S("vllm.platforms.interface:Platform.is_cuda", "signature", "config", "platform switch"),
    _S("vllm.platforms.interface:Platform.device_name", "attribute", "config",
       "named when an fp8 KV cache is refused"),
    _S("vllm.logger:init_logger", "signature", "config", "vLLM's logger"),
    _S("vllm.exceptions:VLLMValidationError", "imported", "config",
       "per-request refusals as HTTP 400"),
    # ------------------------------------------------------------------ runner
    _S("vllm.v1.worker.cpu_worker:CPUModelRunner", "patched", "runner",
       "CPUWorker builds its runner by this module-global name: the DDTree runner"),
    _S("vllm.v1.worker.gpu_worker:Worker._make_model_runner", "patched", "runner",
       "return the DDTree V1 runner when DDTree is on"),
    _S(_RUNNER, "subclassed", "runner", "the runner mixin goes in front of it",
       changes={"0.33": "other methods changed; every method the mixin overrides and every "
                        "attribute it reads has its own row"}),
    _S(_CPU_RUNNER, "subclassed", "runner", "the runner mixin goes in front of it (CPU)"),
    _S(f"{_RUNNER}._prepare_inputs", "overridden", "runner",
       "super first; plan the round after vLLM computed positions and slots"),
    _S(f"{_RUNNER}._build_attention_metadata", "overridden", "runner",
       "super first; attach the tree masks to the target layers' metadata",
       changes={"0.33": "multimodal prefix ranges moved into a helper; the returned "
                        "per-layer metadata DDTree decorates is unchanged"}),
    _S(f"{_RUNNER}._model_forward", "overridden", "runner",
       "wraps super: every target layer's cache write is noted, the first-step guard"),
    _S(f"{_RUNNER}._sample", "overridden", "runner",
       "replaces the rejection sampler for tree steps: the walk and compaction"),
    _S(f"{_RUNNER}.propose_draft_token_ids", "overridden", "runner",
       "condition the drafter on the accepted path (the parameter list is passed through)",
       changes={"0.33": "the Medusa branch is gone; the DFlash branch and the parameters "
                        "are unchanged"}),
    _S(f"{_RUNNER}.load_model", "overridden", "runner", "start-up guard: tree-capable layers"),
    _S(f"{_RUNNER}.initialize_kv_cache", "overridden", "runner",
       "start-up guard: one KV-cache group; the CPU cost profile"),
    _S(f"{_RUNNER}.capture_model", "overridden", "runner", "the cost profile (CUDA)"),
    _S(f"{_RUNNER}.execute_model", "overridden", "runner", "the adaptive budget's step clock"),
    _S(f"{_RUNNER}.take_draft_token_ids", "overridden", "runner",
       "each request's drafts cut to its budget, with their parents"),
    _S(f"{_RUNNER}._update_states_after_model_execute", "overridden", "GDN",
       "every GDN request resumes from state column 0"),
    _S(f"{_RUNNER}._dummy_run", "overridden", "runner",
       "the cost model's start-up profile; full CUDA graphs of tree batches are captured "
       "with the tree path and checked"),
    _S(f"{_RUNNER}.sample_tokens", "overridden", "runner",
       "the device-side guard: a step whose layers skipped the tree path is refused"),
    _S(f"{_RUNNER}.compilation_config", "attribute", "runner",
       "full CUDA graphs for decode batches: cut trees are padded"),
    _S("vllm.config.compilation:CompilationConfig.cudagraph_mode", "attribute", "runner",
       "full CUDA graphs for decode batches"),
    _S("vllm.config.compilation:CUDAGraphMode.decode_mode", "signature", "runner",
       "full CUDA graphs for decode batches"),
    _S("vllm.config:CUDAGraphMode", "imported", "runner", "the graph mode of a forward"),
    _S("vllm.forward_context:get_forward_context", "signature", "runner",
       "whether a forward is a replayed full CUDA graph"),
    _S("vllm.forward_context:is_forward_context_available", "signature", "runner",
       "whether a forward is a replayed full CUDA graph"),
    _S("vllm.forward_context:ForwardContext.cudagraph_runtime_mode", "attribute", "runner",
       "whether a forward is a replayed full CUDA graph"),
    _S("vllm.forward_context:ForwardContext.batch_descriptor", "attribute", "runner",
       "the captured size a replay ran"),
    _S("vllm.forward_context:BatchDescriptor.num_tokens", "attribute", "runner",
       "the captured size a replay ran"),
    _S(f"{_RUNNER}.positions", "attribute", "runner",
       "rewritten to depth positions for the verify forward, restored before drafting"),
    _S(f"{_RUNNER}.req_indices", "attribute", "runner", "per-token request index"),
    _S(f"{_RUNNER}.query_pos", "attribute", "runner", "per-token node index"),
    _S(f"{_RUNNER}.query_start_loc", "attribute", "runner", "request row starts"),
    _S(f"{_RUNNER}.num_decode_draft_tokens", "attribute", "GDN",
       "which rows are decodes; all -1 in plain steps"),
    _S(f"{_RUNNER}.uses_mrope", "attribute", "runner", "M-RoPE targets"),
    _S(f"{_RUNNER}.mrope_positions", "attribute", "runner",
       "shifted by the depth delta for tree nodes, restored before drafting"),
    _S(f"{_RUNNER}.drafter", "attribute", "runner", "replaced by `DDTreeProposer`"),
    _S(f"{_RUNNER}.discard_request_mask", "attribute", "runner",
       "no nodes for requests still prefilling"),
    _S(f"{_RUNNER}.num_accepted_tokens", "attribute", "GDN", "set to 1 after the commit"),
    _S(f"{_RUNNER}.num_accepted_tokens_event", "attribute", "GDN", "recorded after the commit"),
    _S(f"{_RUNNER}.max_num_tokens", "attribute", "runner", "cost profile sizes"),
    _S(f"{_RUNNER}.scheduler_config", "attribute", "runner", "`max_num_seqs`"),
    _S(f"{_RUNNER}.model_config", "attribute", "runner", "`logprobs_mode`"),
    _S(f"{_RUNNER}.input_batch", "attribute", "runner", "the batch's requests"),
    _S(f"{_RUNNER}.execute_model_state", "attribute", "CPU fixes",
       "which rows' samples are discarded (seed rewind)"),
    _S(f"{_BATCH}.req_ids", "attribute", "runner", "request order of the step"),
    _S(f"{_BATCH}.num_reqs", "attribute", "runner", "batch size"),
    _S(f"{_BATCH}.sampling_metadata", "attribute", "sampler", "per-request sampling"),
    _S(f"{_BATCH}.block_table", "attribute", "runner", "slot mappings for compaction"),
    _S(f"{_BATCH}.num_accepted_tokens_cpu_tensor", "attribute", "GDN",
       "set to 1 after the commit"),
    _S(f"{_BATCH}.generators", "attribute", "CPU fixes", "seeded requests' generators"),
    _S("vllm.v1.worker.block_table:MultiGroupBlockTable.__getitem__", "signature", "runner",
       "one group's block table"),
    _S("vllm.v1.worker.block_table:BlockTable.slot_mapping", "attribute", "runner",
       "compaction slots"),
    _S(f"{_BATCH}.req_id_to_index", "attribute", "runner",
       "the rows of requests that gave their blocks back"),
    _S("vllm.v1.worker.block_table:BlockTable.block_table", "attribute", "runner",
       "the drafter blocks of those requests (their pending context rows are dropped)"),
    _S("vllm.v1.worker.block_table:BlockTable.num_blocks_per_row", "attribute", "runner",
       "how many of a row's blocks are its own"),
    _S("vllm.v1.worker.block_table:BlockTable.block_size", "attribute", "runner",
       "slot = block * block_size + offset"),
    _S("vllm.v1.worker.block_table:BlockTable.dcp_world_size", "attribute", "runner",
       "slots are plain block offsets only without decode context parallelism"),
    _S("vllm.v1.outputs:SamplerOutput", "imported", "runner", "the walk's output"),
    _S("vllm.v1.outputs:ModelRunnerOutput", "imported", "runner",
       "a step's output: carries its drafts (`ddtree_drafts`)"),
    _S("vllm.v1.outputs:EMPTY_MODEL_RUNNER_OUTPUT", "imported", "runner",
       "vLLM's shared empty output: never carries drafts"),
    _S("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", "patched", "scheduler",
       "note the drafts a step's output carries",
       changes={"0.33": "the body changed, the signature did not; the wrapper only reads "
                        "an attribute of the output before calling it"}),
    _S("vllm.v1.engine.core:EngineCore.post_step", "patched", "scheduler",
       "a step's drafts from its output, not a second call to the workers"),
    _S("vllm.v1.engine.core:EngineCore.scheduler", "attribute", "scheduler",
       "where post_step finds the noted drafts"),
    _S("vllm.v1.engine.core:EngineCore.async_scheduling", "attribute", "scheduler",
       "vLLM's own condition for taking drafts"),
    _S("vllm.v1.engine.core:EngineCore.check_for_draft_tokens", "attribute", "scheduler",
       "vLLM's own condition for taking drafts"),
    _S("vllm.v1.outputs:SamplerOutput.sampled_token_ids", "attribute", "runner",
       "accepted path + bonus, -1 padded"),
    _S("vllm.v1.outputs:SamplerOutput.logprobs_tensors", "attribute", "sampler",
       "logprobs of the output tokens"),
    _S("vllm.v1.spec_decode.metadata:SpecDecodeMetadata.draft_token_ids", "attribute",
       "scheduler", "the scheduled nodes"),
    _S("vllm.v1.spec_decode.metadata:SpecDecodeMetadata.num_draft_tokens", "attribute",
       "scheduler", "nodes per request"),
    _S("vllm.v1.spec_decode.metadata:SpecDecodeMetadata.max_spec_len", "attribute",
       "scheduler", "output width"),
    _S("vllm.v1.core.sched.output:SchedulerOutput.scheduled_spec_decode_tokens", "attribute",
       "scheduler", "the scheduled drafts of each request"),
    _S("vllm.v1.core.sched.output:SchedulerOutput.total_num_scheduled_tokens", "attribute",
       "scheduler", "rows of the step"),
    _S("vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens", "attribute",
       "scheduler", "requests of the step (step clock)"),
    _S("vllm.model_executor.layers.attention:Attention", "imported", "runner",
       "start-up guard: isinstance"),
    _S("vllm.model_executor.layers.attention.attention:Attention.impl", "attribute", "runner",
       "start-up guard: the tree-capable impl"),
    _S("vllm.model_executor.layers.attention.attention:Attention.attn_backend", "attribute",
       "runner", "start-up guard message"),
    _S("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase", "imported",
       "runner", "layer enumeration"),
    # ------------------------------------------------------------------ proposer
    _S(_DFLASH, "subclassed", "proposer", "`DDTreeProposer`"),
    _S(f"{_DFLASH}.__init__", "overridden", "proposer",
       "sized with `num_speculative_tokens = max(budget, depth)` during super"),
    _S(f"{_DFLASH}._sample_draft_tokens", "overridden", "proposer",
       "keep the drafter's logits instead of the argmax"),
    _S(f"{_DFLASH}.set_inputs_first_pass", "signature", "proposer",
       "context-only steps (plain mode)"),
    _S(f"{_DFLASH}._dflash_num_context", "attribute", "proposer", "context-only steps"),
    _S(f"{_DFLASH}._dflash_hidden_states", "attribute", "proposer", "context-only steps"),
    _S(f"{_DFLASH}._context_positions_buffer", "attribute", "proposer", "context-only steps"),
    _S(f"{_DFLASH}._context_slot_mapping_buffer", "attribute", "proposer",
       "context-only steps"),
    _S(f"{_BASE_PROP}.input_ids", "attribute", "proposer",
       "start-up guard: holds `max_num_seqs * (1 + depth)` query ids"),
    _S(f"{_BASE_PROP}.max_batch_size", "attribute", "proposer", "start-up guard"),
    _S(f"{_BASE_PROP}.max_num_tokens", "attribute", "proposer", "start-up guard message"),
    _S(f"{_BASE_PROP}.propose", "overridden", "proposer",
       "called with the drafter depth; the trees are built from the kept logits"),
    _S(f"{_BASE_PROP}.load_model", "overridden", "proposer",
       "records the target's attention layers first",
       changes={"0.33": "also marks the drafter's layers `is_draft_layer`; the target "
                        "layers DDTree records before super are the same"}),
    _S(f"{_BASE_PROP}.dummy_run", "signature", "runner", "the cost model's drafter profile"),
    _S(f"{_BASE_PROP}.kv_cache_gid", "attribute", "proposer",
       "the drafter's KV-cache group (plain mode)"),
    _S(f"{_BASE_PROP}.model", "attribute", "proposer", "the drafter model"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3ForCausalLM.combine_hidden_states", "signature",
       "proposer", "context-only steps"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3ForCausalLM.precompute_and_store_context_kv",
       "signature", "proposer", "context-only steps"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3ForCausalLM.compute_logits", "signature", "proposer",
       "per-position draft logits"),
    _S("vllm.v1.attention.backend:CommonAttentionMetadata.batch_size", "signature",
       "proposer", "placeholder drafts of a context-only step"),
    # ------------------------------------------------------------------ sampler
    _S(f"{_SMD}.allowed_token_ids_mask", "attribute", "sampler", "per node; banned in trees"),
    _S(f"{_SMD}.bad_words_token_ids", "attribute", "sampler", "per node"),
    _S(f"{_SMD}.output_token_ids", "attribute", "sampler", "node histories"),
    _S(f"{_SMD}.prompt_token_ids", "attribute", "sampler", "penalties"),
    _S(f"{_SMD}.no_penalties", "attribute", "sampler", "penalties"),
    _S(f"{_SMD}.frequency_penalties", "attribute", "sampler", "penalties"),
    _S(f"{_SMD}.presence_penalties", "attribute", "sampler", "penalties"),
    _S(f"{_SMD}.repetition_penalties", "attribute", "sampler", "penalties"),
    _S(f"{_SMD}.max_num_logprobs", "attribute", "sampler", "logprobs"),
    _S(f"{_SMD}.logitsprocs", "attribute", "sampler", "built-in processors' state"),
    _S(f"{_SMD}.all_greedy", "attribute", "sampler", "greedy walk"),
    _S(f"{_SMD}.temperature", "attribute", "sampler", "sampling walk"),
    _S(f"{_SMD}.top_k", "attribute", "sampler", "sampling walk"),
    _S(f"{_SMD}.top_p", "attribute", "sampler", "sampling walk"),
    _S(f"{_SMD}.generators", "attribute", "sampler", "seeded requests' draws"),
    _S(f"{_BUILTIN}:MinTokensLogitsProcessor", "imported", "sampler", "per-node min_tokens"),
    _S(f"{_BUILTIN}:MinTokensLogitsProcessor.min_toks", "attribute", "sampler",
       "per-node min_tokens"),
    _S(f"{_BUILTIN}:MinTokensLogitsProcessor._mask_stop_token_logits", "attribute",
       "sampler", "per-node min_tokens"),
    _S(f"{_BUILTIN}:MinTokensLogitsProcessor.neg_inf_tensor", "attribute", "sampler",
       "per-node min_tokens"),
    _S(f"{_BUILTIN}:LogitBiasLogitsProcessor", "imported", "sampler", "logit_bias"),
    _S(f"{_BUILTIN}:LogitBiasLogitsProcessor.biases", "attribute", "sampler", "logit_bias"),
    _S(f"{_BUILTIN}:MinPLogitsProcessor", "imported", "sampler", "min_p"),
    _S(f"{_BUILTIN}:MinPLogitsProcessor.min_p", "attribute", "sampler", "min_p"),
    _S(f"{_BUILTIN}:MinPLogitsProcessor.min_p_count", "attribute", "sampler", "min_p"),
    _S("vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS", "imported", "sampler",
       "all three built in for DDTree"),
    _S("vllm.v1.sample.logits_processor:LOGITSPROCS_GROUP", "imported", "sampler",
       "custom processors stay refused"),
    _S("vllm.v1.sample.logits_processor:LogitsProcessors", "imported", "sampler",
       "the built processors"),
    _S("vllm.v1.worker.gpu_model_runner:build_logitsprocs", "patched", "sampler",
       "with DDTree, build all three built-in logits processors"),
    _S("vllm.v1.sample.ops.bad_words:apply_bad_words", "signature", "sampler", "per node"),
    _S("vllm._custom_ops:apply_repetition_penalties", "signature", "sampler", "per node"),
    _S("vllm.model_executor.layers.utils:get_token_bin_counts_and_mask", "signature",
       "sampler", "per-node penalties"),
    _S("vllm.utils.torch_utils:make_tensor_with_pad", "signature", "sampler",
       "per-node histories"),
    _S("vllm.v1.sample.sampler:Sampler.gather_logprobs", "signature", "sampler",
       "logprobs of the output tokens"),
    # ------------------------------------------------------------------ structured output
    _S("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids", "patched",
       "structured output", "check drafts against the grammar per tree path"),
    _S(f"{_SOM}.grammar_bitmask", "patched", "structured output",
       "one bitmask row per tree node", changes={"0.33": _BITMASK_033}),
    _S("vllm.v1.core.sched.scheduler:Scheduler.schedule", "patched", "structured output",
       "the dropped nodes ride on the scheduler output",
       changes={"0.33": "new scheduling policies (prefill cadence, deferred KV loads) and "
                        "`SchedulerOutput.skip_drafts`, read only by Model Runner V2; the "
                        "wrapper only adds `ddtree_pruned` to the output"}),
    _S(f"{_SOM}._fill_bitmasks", "signature", "structured output",
       "fill one node's row", changes={"0.33": _BITMASK_033}),
    _S(f"{_SOM}._get_constraint_bounds", "signature", "structured output",
       "whether the grammar is active"),
    _S(f"{_SOM}._grammar_bitmask", "attribute", "structured output", "the bitmask buffer"),
    _S(f"{_SOM}.backend", "attribute", "structured output", "`allocate_token_bitmask`"),
    _S(f"{_SOM}._masked_reasoning_ends", "signature", "structured output",
       "the 4th tuple entry of `_fill_bitmasks` (rows before the grammar starts mask the "
       "implicit reasoning ends)", since="0.33"),
    _S(f"{_SOM}.vllm_config", "attribute", "structured output", "budget, max_num_seqs"),
    _S("vllm.v1.structured_output:_CONSTRAINED_FROM_START", "imported", "structured output",
       "the grammar is active from the first token"),
    _S("vllm.v1.structured_output.utils:apply_grammar_bitmask", "signature",
       "structured output", "not called: the runner applies the rows in the layout "
                            "`grammar_bitmask` produced",
       changes={"0.33": "steps by `bitmask.shape[0] // len(requests)`: the fixed-stride "
                        "layout, which the plugin then fills"}),
    _S(f"{_GRAMMAR}.validate_tokens", "signature", "structured output", "per tree path"),
    _S(f"{_GRAMMAR}.accept_tokens", "signature", "structured output", "per tree path"),
    _S(f"{_GRAMMAR}.rollback", "signature", "structured output", "per tree path"),
    _S(f"{_GRAMMAR}.is_terminated", "signature", "structured output", "per tree path"),
    _S(f"{_REQ}.spec_token_ids", "attribute", "structured output", "the pruned drafts"),
    _S(f"{_REQ}.use_structured_output", "attribute", "structured output", "grammar requests"),
    _S(f"{_REQ}.structured_output_request", "attribute", "structured output", "its grammar"),
    _S(f"{_REQ}.is_prefill_chunk", "attribute", "structured output",
       "no drafts while prefilling"),
    _S(f"{_REQ}.is_finished", "signature", "structured output", "skipped"),
    _S("vllm.v1.core.sched.scheduler:Scheduler.requests", "attribute", "structured output",
       "the scheduler's requests"),
    _S("vllm.v1.core.sched.scheduler:Scheduler.structured_output_manager", "attribute",
       "structured output", "its grammars"),
    _S("vllm.v1.outputs:DraftTokenIds", "subclassed", "structured output",
       "`DDTreeDraftTokenIds` adds the trees' parents"),
    _S("vllm.v1.outputs:DraftTokenIds.draft_token_ids", "attribute", "runner",
       "lists, cut to each request's budget"),
    # ------------------------------------------------------------------ attention
    _S("vllm.v1.attention.backends.registry:register_backend", "signature", "attention",
       "override `CPU_ATTN`, register `DDTREE`"),
    _S("vllm.v1.attention.backends.registry:AttentionBackendEnum", "imported", "attention",
       "backend names"),
    _S("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN", "attribute",
       "attention", "overridden on CPU"),
    _S("vllm.v1.attention.backend:AttentionCGSupport", "imported", "attention",
       "the DDTREE builder's CUDA-graph support"),
    _S("vllm.v1.attention.backend:AttentionType", "imported", "attention",
       "decoder layers only"),
    _S(f"{_CPU_ATTN}:CPUAttentionBackend", "subclassed", "attention", "the CPU tree backend",
       changes={"0.33": "adds `supports_kv_cache_dtype` (fp8 on AMX/AVX-512); DDTree checks "
                        "fp8 support itself before start (`_get_attn_isa`)"}),
    _S(f"{_CPU_ATTN}:CPUAttentionBackendImpl", "subclassed", "attention", "the CPU tree impl"),
    _S(f"{_CPU_ATTN}:CPUAttentionBackendImpl.kv_cache_dtype", "attribute", "attention",
       "the cache's fp8 kind: tree kernels decode it, compaction moves its bytes"),
    _S("vllm.v1.attention.backend:AttentionLayer._k_scale_float", "attribute", "attention",
       "the per-tensor K scale of an fp8 cache, applied by the tree kernels"),
    _S("vllm.v1.attention.backend:AttentionLayer._v_scale_float", "attribute", "attention",
       "the per-tensor V scale of an fp8 cache, applied by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward", "overridden", "attention",
       "tree steps run the tree kernel, others the stock op"),
    _S(f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update", "overridden", "attention",
       "capture each target layer's cache write (compaction, guard)"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", "subclassed", "attention",
       "forces the `vec` ISA with DDTree on"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.isa", "attribute", "attention",
       "set to `vec` (AMX packs K/V in tiles)"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder._set_isa_to_layers", "signature",
       "attention", "set to `vec`"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.block_table", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.query_start_loc", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.seq_lens", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.max_seq_len", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.max_query_len", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.num_actual_tokens", "attribute", "attention",
       "read by the tree kernels"),
    _S(f"{_CPU_ATTN}:CPUAttentionMetadata.causal", "attribute", "attention",
       "tree steps must be causal"),
    _S(f"{_TRITON}:TritonAttentionBackend", "subclassed", "attention", "the DDTREE backend"),
    _S(f"{_TRITON}:TritonAttentionImpl", "subclassed", "attention", "the DDTREE impl",
       changes={"0.33": _PTR_RANGE_033}),
    _S(f"{_TRITON}:TritonAttentionImpl.forward", "overridden", "attention",
       "tree steps run the Triton tree kernel", changes={"0.33": _PTR_RANGE_033}),
    _S(f"{_TRITON}:TritonAttentionImpl.do_kv_cache_update", "overridden", "attention",
       "capture each target layer's cache write", changes={"0.33": _PTR_RANGE_033}),
    _S(f"{_TRITON}:TritonAttentionImpl.supports_quant_query_input", "attribute", "attention",
       "turned off with an fp8 cache: the tree kernel reads model-dtype queries"),
    _S("vllm.model_executor.layers.attention.attention:Attention.query_quant", "attribute",
       "attention", "built only for impls whose supports_quant_query_input is set"),
    _S(f"{_TRITON}:TritonAttentionImpl.chunk_lookback", "attribute", "attention",
       "refused when set"),
    _S(f"{_TRITON}:TritonAttentionMetadataBuilder", "subclassed", "attention",
       "the DDTREE builder",
       changes={"0.33": "sizes the 3D-decode scratch for verification queries; DDTree's "
                        "tree steps run the tree kernel, other steps the stock path"}),
    _S(f"{_TRITON}:TritonAttentionMetadataBuilder._cudagraph_support", "attribute",
       "attention", "`UNIFORM_SINGLE_TOKEN_DECODE`: tree masks are attached after build"),
    _S(f"{_TRITON}:TritonAttentionMetadata.mm_prefix_range_tensor", "attribute", "attention",
       "refused when set"),
    _S(f"{_TRITON}:TritonAttentionMetadata.causal", "attribute", "attention",
       "tree steps must be causal"),
    # ------------------------------------------------------------------ GDN
    _S(f"{_CPU_GDN}:_spec_forward", "patched", "GDN",
       "verify each speculative GDN token along its own tree path",
       changes={"0.33": "the chain's conv-buffer layout is fixed and fp16 with Triton "
                        "bypasses this function; a CPU-only patch, and vLLM CPU has no 0.33 "
                        "wheel, so it stays pinned to 0.32 (the first-step guard raises if "
                        "GDN layers skip the tree path)"}),
    _S(f"{_CPU_GDN}:_unpacked_conv_weight", "signature", "GDN", "the conv weight"),
    _S(f"{_CPU_GDN}:_spec_aware_nonspec", "patched", "GDN",
       "plain decode and prefill rows on the C++ conv kernels where the conv weight is packed"),
    _S(f"{_CPU_GDN}:_spec_aware_nonspec_subset", "patched", "GDN",
       "prefill rows beside speculative ones on the C++ conv where the conv weight is packed"),
    _S(f"{_GDN_MD}.prefill_state_indices", "attribute", "GDN",
       "state slots of prefill rows beside speculative ones"),
    _S(f"{_GDN_MD}.prefill_query_start_loc", "attribute", "GDN",
       "query starts of prefill rows beside speculative ones"),
    _S(f"{_CPU_GDN}:_causal_conv1d_update_cpu", "signature", "GDN",
       "the C++ conv update of plain decode rows"),
    _S(f"{_CPU_GDN}:_causal_conv1d_fwd_cpu", "signature", "GDN",
       "the C++ conv of plain prefill rows"),
    _S("fused_gdn_gating_cpu", "op", "GDN", "the gates of plain prefill rows"),
    _S("chunk_gated_delta_rule_cpu", "op", "GDN", "the recurrence of plain prefill rows"),
    _S(f"{_CPU_GDN}:is_arm_bf16", "signature", "GDN", "where the stock path is kept"),
    _S("fused_sigmoid_gating_delta_rule_update_cpu", "op", "GDN",
       "the recurrence of plain decode rows"),
    _S(f"{_GDN_MD}.non_spec_state_indices_tensor", "attribute", "GDN",
       "state slots of plain rows (a dense copy for one row)"),
    _S(f"{_GDN_MD}.non_spec_query_start_loc", "attribute", "GDN", "plain decode rows"),
    _S(f"{_GDN_MD}.num_decode_tokens", "attribute", "GDN", "plain decode rows"),
    _S("fused_sigmoid_gating_delta_rule_update_spec_cpu", "op", "GDN",
       "the recurrence in waves"),
    _S(f"{_GDN_MD}.num_spec_decodes", "attribute", "GDN", "tree rows"),
    _S(f"{_GDN_MD}.spec_state_indices_tensor", "attribute", "GDN", "state slots"),
    _S(f"{_GDN_MD}.spec_query_start_loc", "attribute", "GDN", "tree rows"),
    _S(f"{_GDN_MD}.num_accepted_tokens", "attribute", "GDN", "conv window offsets"),
    _S(f"{_GDN_MD}.num_prefills", "attribute", "GDN", "mixed steps"),
    _S(f"{_GDN_MD}.num_decodes", "attribute", "GDN", "mixed steps"),
    _S(f"{_GDN_MD}.spec_token_indx", "attribute", "GDN", "tree rows"),
    _S(f"{_GDN_MD}.spec_sequence_masks", "attribute", "GDN", "tree rows"),
    _S(_GDN_LAYER, "imported", "GDN", "start-up guard: isinstance"),
    _S(f"{_GDN_LAYER}.prefix", "attribute", "GDN", "layer name"),
    _S(f"{_GDN_LAYER}.conv1d", "attribute", "GDN", "conv bias"),
    _S(f"{_GDN_LAYER}.activation", "attribute", "GDN", "conv activation"),
    _S(f"{_GDN_LAYER}.A_log", "attribute", "GDN", "gating"),
    _S(f"{_GDN_LAYER}.dt_bias", "attribute", "GDN", "gating"),
    _S(f"{_GDN_LAYER}.rearrange_mixed_qkv", "signature", "GDN", "q, k, v split"),
    _S("vllm.model_executor.layers.mamba.abstract:MambaBase", "imported", "GDN",
       "non-attention layers"),
    _S(f"{_GDN_LAYER}._forward_core", "patched", "GDN",
       "CUDA: mark the GDN layer running in a tree step",
       changes={"0.33": "FlashInfer prefill checkpoints in the prefill branch; the two "
                        "speculative kernel calls and their arguments are unchanged"}),
    _S(f"{_GDN_MOD}:causal_conv1d_update", "patched", "GDN",
       "CUDA: the speculative conv update follows each node's parent",
       changes={"0.33": "the prefix-cache arguments `block_idx_last_scheduled_token` and "
                        "`initial_state_idx` are gone; the replacement binds arguments by "
                        "name and refuses those only when given"}),
    _S(f"{_GDN_MOD}:fused_sigmoid_gating_delta_rule_update", "patched", "GDN",
       "CUDA: the speculative recurrence starts each node from its parent's state"),
    _S(f"{_GDN_MOD}:get_forward_context", "imported", "GDN",
       "CUDA: the layer's metadata in a tree step"),
    _S(f"{_GDN_LAYER}.enable_fused_gdn_spec_decode", "attribute", "GDN",
       "CUDA: turned off (the fused kernel verifies chains)"),
    # ------------------------------------------------------------------ metrics
    _S("vllm.v1.metrics.loggers:StatLoggerManager.__init__", "patched", "metrics",
       "add `DDTreeStatLogger` only when DDTree is on"),
    _S("vllm.v1.metrics.loggers:AggregateStatLoggerBase", "subclassed", "metrics",
       "`DDTreeStatLogger`"),
    # ------------------------------------------------------------------ CPU fixes
    _S(f"{_CPU_RUNNER}.sample_tokens", "patched", "CPU fixes",
       "save the generator states of discarded seeded samples"),
    _S(f"{_CPU_RUNNER}._bookkeeping_sync", "patched", "CPU fixes",
       "restore them instead of the CUDA-only offset rewind"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3Model._normalize_context_k", "patched", "CPU fixes",
       "normalise the drafter's context keys layer by layer"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3Model._k_norm_weights", "attribute", "CPU fixes",
       "each layer's K-norm weight"),
    _S("vllm._custom_ops:rms_norm", "signature", "CPU fixes", "the per-layer K-norm"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3Model._project_context_kv", "patched", "CPU fixes",
       "the drafter's context K/V projection on oneDNN, K and V written per layer in place"),
    _S(f"{_DFLASH_MODEL}:DFlashQwen3Model._build_fused_kv_buffers", "attribute", "CPU fixes",
       "builds the fused context weight (`_fused_kv_weight`, rows [layer, K/V, head, dim]) "
       "the projection reads"),
    _S("vllm._custom_ops:create_onednn_mm", "signature", "CPU fixes",
       "pack a context K or V weight block for oneDNN"),
    _S("vllm._custom_ops:_supports_onednn", "attribute", "CPU fixes",
       "whether the CPU build has oneDNN GEMMs"),
    _S("vllm._custom_ops:CPUDNNLGEMMHandler.__del__", "patched", "CPU fixes",
       "release the oneDNN GEMM handle without tensor dispatch (safe under FakeTensorMode)"),
    _S("vllm._custom_ops:CPUDNNLGEMMHandler.handler_tensor", "attribute", "CPU fixes",
       "the handle's address, a 0-dim int64 tensor"),
    _S("vllm._custom_ops:CPUDNNLGEMMHandler.dtor", "attribute", "CPU fixes",
       "the release op (`release_dnnl_matmul_handler`)"),
]


def by_target() -> dict[str, Seam]:
    out: dict[str, Seam] = {}
    for s in SEAMS:
        if s.target in out:
            raise ValueError(f"seam {s.target} is listed twice")
        out[s.target] = s
    return out
