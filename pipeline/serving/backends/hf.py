"""In-process transformers backend: samples token by token so ids and log-probs are exact.

Each request snapshots the (model, version, adapter) triple of its arm when it starts: the
stable arm's, or the canary's when the gateway routes it there and a canary is loaded. A
full-weights version is loaded into a shadow copy of the model; a LoRA version (a folder with
``adapter_config.json``) is a small set of tensors applied to the base model, which is loaded
once (:mod:`.lora`). Either way a triple is swapped between requests: in-flight requests
finish on the weights they started with, so every interaction records the version that really
produced it and nothing waits for a reload.

Two versions at once (a canary beside the stable version): two adapters cost two adapters'
tensors over one base model, and each request selects its own per thread (``lora.active``);
two full-weight versions are two models in memory (three while the base's is kept for
adapters and for going back to it). A rollout moves the canary's loaded triple to the stable
arm, nothing is read again.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import lora
from .base import Done, Piece, SamplingParams, StopReason

log = logging.getLogger(__name__)


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class HFBackend:
    """A causal LM from a local directory, on CPU or CUDA."""

    def __init__(
        self,
        model_path: Path,
        *,
        policy_id: str | None = None,
        version: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        workers: int = 4,
        context_length: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path)
        self.policy_id = policy_id or self.model_path.name
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_dtype(dtype))
        # transformers' decorator on PreTrainedModel.to hides its signature from the checker.
        model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.device = device
        self.context_length = context_length or int(
            getattr(model.config, "max_position_embeddings", 2048)
        )
        self._base = model  # adapters always apply to the weights loaded at start
        self.base_fingerprint = _fingerprint(self.model_path)
        self._live: tuple[Any, int, lora.Adapter | None] = (model, version, None)
        self._initial = self._live  # what serve_base goes back to
        # the canary arm: its triple and the share of users routed to it (None: no canary)
        self._canary: tuple[tuple[Any, int, lora.Adapter | None], float] | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hf-gen")
        self._reload_lock = threading.Lock()
        self.eos_ids = self._eos_ids(model)

    @property
    def version(self) -> int:
        """The stable arm's version."""
        return self._live[1]

    @property
    def canary(self) -> tuple[int, float] | None:
        """(version, share) of the loaded canary, None without one."""
        c = self._canary
        return None if c is None else (c[0][1], c[1])

    def _eos_ids(self, model: Any) -> set[int]:
        ids: set[int] = set()
        for value in (self.tokenizer.eos_token_id, model.generation_config.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, canary: bool = False
    ) -> AsyncIterator[Piece | Done]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Piece | Done | BaseException] = asyncio.Queue()
        cancel = threading.Event()
        arm = self._canary if canary else None  # no canary (dropped meanwhile): stable
        model, version, adapter = arm[0] if arm is not None else self._live  # the snapshot

        def emit(item: Piece | Done | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def run() -> None:
            try:
                with lora.active(adapter):
                    reason = self._sample(model, prompt_ids, params, emit, cancel)
                emit(Done(finish_reason=reason, weight_version=version))
            except BaseException as exc:  # surfaced to the awaiting request
                emit(exc)

        self._pool.submit(run)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            cancel.set()  # client went away or we are done: stop sampling

    def _sample(
        self,
        model: Any,
        prompt_ids: list[int],
        params: SamplingParams,
        emit: Any,
        cancel: threading.Event,
    ) -> StopReason:
        import torch

        gen = torch.Generator(device=self.device)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        out_ids: list[int] = []
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids], device=self.device)
            out = model(input_ids=ids, use_cache=True)
            for _ in range(params.max_tokens):
                if cancel.is_set():
                    return "abort"
                logits = out.logits[0, -1].float()
                raw_logprobs = torch.log_softmax(logits, dim=-1)
                token = _pick(logits, params, gen)
                out_ids.append(token)
                emit(Piece([token], [float(raw_logprobs[token])]))
                if token in self.eos_ids:
                    return "stop"
                if params.stop and self._hit_stop(out_ids, params.stop):
                    return "stop"
                if len(out_ids) >= params.max_tokens:
                    break  # no forward pass for a token nobody will read
                out = model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return "length"

    def _hit_stop(self, out_ids: list[int], stop: list[str]) -> bool:
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return any(s in text for s in stop)

    async def reload(self, path: Path, version: int) -> None:
        """Serve ``version`` on the stable arm (newer or older: the reloader decides)."""
        await asyncio.to_thread(self._reload, Path(path), version)

    def _reload(self, path: Path, version: int) -> None:
        with self._reload_lock:
            if version == self._live[1]:
                return
            c = self._canary
            if c is not None and c[0][1] == version:  # a rollout: its weights are loaded
                self._live = c[0]
            else:
                self._live = self._load(path, version)  # atomic swap between requests
            log.info("policy %s now serving version %d", self.policy_id, version)

    async def load_canary(self, path: Path, version: int, share: float) -> None:
        """Serve ``version`` to the canary arm (``share``: the users routed to it)."""
        await asyncio.to_thread(self._load_canary, Path(path), version, share)

    def _load_canary(self, path: Path, version: int, share: float) -> None:
        with self._reload_lock:
            c = self._canary
            if c is not None and c[0][1] == version:
                self._canary = (c[0], share)
                return
            triple = self._live if version == self._live[1] else self._load(path, version)
            self._canary = (triple, share)
            log.info(
                "policy %s: canary v%d for %.0f%% of users", self.policy_id, version, share * 100
            )

    async def drop_canary(self) -> None:
        """No canary: its users are answered by the stable arm from their next request
        (requests running on it finish on it)."""
        self._canary = None

    async def serve_base(self) -> None:
        """The stable arm back to the weights this backend started with (every version
        withdrawn)."""
        with self._reload_lock:
            self._live = self._initial
        log.info("policy %s now serving its base weights (v%d)", self.policy_id, self._initial[1])

    def _load(self, path: Path, version: int) -> tuple[Any, int, lora.Adapter | None]:
        if lora.is_adapter_dir(path):
            return self._reload_adapter(path, version)
        return self._reload_full(path, version)

    def _reload_adapter(self, path: Path, version: int) -> tuple[Any, int, lora.Adapter]:
        expected = _manifest_base(path)
        if expected is not None and expected != self.base_fingerprint:
            raise ValueError(
                f"adapter v{version} was trained on another base model (fingerprint "
                f"{expected[:12]}, serving {self.base_fingerprint[:12]} from {self.model_path})"
            )
        adapter = lora.load_adapter(
            path, version, device=self.device, dtype=next(self._base.parameters()).dtype
        )
        lora.check_fits(self._base, adapter)
        lora.wrap_targets(self._base, adapter)  # a no-op after the first adapter
        return self._base, version, adapter

    def _reload_full(self, path: Path, version: int) -> tuple[Any, int, None]:
        from safetensors.torch import load_file

        current = self._live[0]
        shadow = copy.deepcopy(current)
        state: dict[str, Any] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        for file in files:
            state.update(load_file(str(file), device=self.device))
        missing, unexpected = shadow.load_state_dict(state, strict=False)
        tied = set(getattr(shadow, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(
                f"weights in {path} do not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        shadow.eval()
        return shadow, version, None  # swapped in by the caller; running requests keep theirs

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fingerprint(model_path: Path) -> str:
    from pipeline.models.store import fingerprint

    return fingerprint(model_path)


def _manifest_base(path: Path) -> str | None:
    """The base-model fingerprint a version's manifest records, if any."""
    import json

    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    base = manifest.get("base_model") or {}
    return base.get("fingerprint") if isinstance(base, dict) else None


# Below this, logits / temperature overflows float32 and sampling is greedy in all but name.
MIN_TEMPERATURE = 1e-4


def _pick(logits: Any, params: SamplingParams, gen: Any) -> int:
    """Greedy at temperature ~0, else temperature + nucleus sampling."""
    import torch

    if params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        return int(torch.argmax(logits))
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        keep[0] = True
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_p[keep]
        probs = filtered / filtered.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
