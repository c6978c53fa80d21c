"""Every vLLM seam that is a monkey-patch, one module each (see README.md here)."""

from vllm_ddtree.patches.base import Patch, PatchError

__all__ = ["Patch", "PatchError", "all_patches"]


def all_patches() -> list[Patch]:
    """The patches the plugin applies, in order."""
    from vllm_ddtree.patches import (cpu_dflash_context_gemm, cpu_dflash_k_norm,
                                     cpu_gemm_handler_del, cpu_seed_rewind,
                                     gdn_plain_decode, gdn_tree, gdn_tree_cuda, logitsprocs,
                                     model_runner, request_params, spec_config, stat_loggers,
                                     step_drafts, structured_output)

    return [spec_config.PATCH, spec_config.PREFIX_CACHING_DEFAULT, spec_config.BATCH_DEFAULTS,
            spec_config.DRAFTING_SLOTS,
            request_params.PATCH,
            logitsprocs.PATCH, model_runner.CPU_RUNNER, model_runner.CUDA_RUNNER,
            stat_loggers.PATCH, cpu_seed_rewind.SNAPSHOT, cpu_seed_rewind.REWIND,
            cpu_dflash_k_norm.PATCH, cpu_dflash_context_gemm.PATCH, cpu_gemm_handler_del.PATCH, gdn_tree.PATCH,
            gdn_plain_decode.PATCH, gdn_plain_decode.SUBSET,
            *gdn_tree_cuda.PATCHES, structured_output.UPDATE_DRAFTS, structured_output.BITMASK,
            structured_output.SCHEDULE, *step_drafts.PATCHES]
