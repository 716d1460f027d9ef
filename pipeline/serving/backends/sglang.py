"""SGLang server backend over HTTP; never imports sglang.

We render the chat template ourselves and send ``input_ids`` to ``POST /generate`` with
``return_logprob``; the answer's ``output_ids`` and ``meta_info.output_token_logprobs`` are the
engine's own tokens and log-probs, never re-tokenized. Start SGLang with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so its log-probs use the same basis as the hf backend
(raw distribution, temperature 1); otherwise they are the sampler's temperature/top-p ones.
Generation is one non-streaming call; the gateway still streams it to the client as SSE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from .base import Done, Piece, SamplingParams


class SGLangError(RuntimeError):
    """The SGLang server failed or answered something we cannot use."""


class SGLangBackend:
    def __init__(
        self,
        url: str,
        tokenizer_path: Path,
        *,
        policy_id: str,
        version: int = 0,
        context_length: int = 32768,
        timeout_s: float = 600.0,
    ) -> None:
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.policy_id = policy_id
        self.context_length = context_length
        self._version = version
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Piece | Done]:
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_tokens,
        }
        if params.stop:
            sampling["stop"] = params.stop
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body = {
            "input_ids": prompt_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": False,
        }
        try:
            resp = await self._client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise SGLangError(f"SGLang at {self.url} unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise SGLangError(f"SGLang /generate answered {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        meta = data.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        if not pairs and data.get("output_ids"):
            raise SGLangError("SGLang returned no output_token_logprobs (return_logprob ignored?)")
        if data.get("output_ids") is not None and list(data["output_ids"]) != ids:
            raise SGLangError("SGLang output_ids and output_token_logprobs disagree")
        yield Piece(ids, logprobs)
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        reason = finish if finish in ("stop", "length", "abort") else "stop"
        yield Done(finish_reason=reason, weight_version=_version(meta, self._version))

    async def reload(self, path: Path, version: int) -> None:
        body = {
            "model_path": str(path),
            "weight_version": str(version),
            "abort_all_requests": False,
        }
        try:
            resp = await self._client.post("/update_weights_from_disk", json=body)
        except httpx.HTTPError as exc:
            raise SGLangError(f"SGLang at {self.url} unreachable: {exc}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code != 200 or not isinstance(data, dict) or not data.get("success"):
            detail = data.get("message") if isinstance(data, dict) else None
            raise SGLangError(f"update_weights_from_disk failed: {detail or resp.text[:300]}")
        self._version = max(self._version, version)

    async def close(self) -> None:
        await self._client.aclose()


def _version(meta: dict[str, Any], fallback: int) -> int:
    """SGLang reports the version that produced a response as a string; trust it over ours."""
    raw = meta.get("weight_version")
    try:
        return int(raw) if raw is not None else fallback
    except (TypeError, ValueError):
        return fallback
