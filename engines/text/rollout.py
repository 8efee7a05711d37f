"""The embedded rollout engine: a transformers causal LM sampled with a KV cache and continuous batching.

What it owns: one model, one dedicated decode thread (started in the constructor, stopped by
``close()``), the batch of in-flight sequences with their KV cache, and the FIFO of requests
waiting for a slot. Everything touching the model or the cache runs on that thread; callers
on any event loop submit work and receive results through ``loop.call_soon_threadsafe``.

Continuous batching: every decode step feeds each in-flight row its newest token. A finished
row leaves the batch at once (``index_select`` on the cache); a waiting request joins by
prefilling alone (or with same-length peers, so no padding) and merging its cache into the
batch, left-padded to the batch length with an attention mask and explicit ``position_ids``;
padding columns every row has outgrown are trimmed. So no compute is spent on finished rows,
and the only padding is the left gap between rows of different lengths.

Kept caches (multi-turn episodes): a request marked ``continued`` will be followed by one that
extends its prompt and response (the episode's next turn, after the environment answered). When
such a row finishes, its cache is kept under ``(prompt_id, index)``; the next request of that
sequence whose prompt starts with the kept tokens joins by encoding only the new tokens (the last
turn's final token and the observation) on top of it, instead of the whole transcript again.

Invariants:
- each row's cache holds exactly ``prompt + response[:-1]``; its newest token is fed next step;
- every kept cache was built by the weights serving now: all are dropped when a new version
  commits (and a row that kept its cache across an update under ``KEEP_CACHE`` is not kept), so
  a turn that starts after an update is encoded wholly under the new weights, as without them.
  A kept cache is used once, and at most ``max_batch_size`` are held (the oldest go first): they
  never outweigh the running batch's own cache;
- ``len(response_ids) == len(behaviour_logprobs) == len(token_versions)``, and every token is
  stamped with the version of the weights whose logits it was sampled from;
- weights change only between decode steps, all tensors at once or none: they arrive through
  param_sync into the engine's :class:`~param_sync.ModuleTarget` (``engine.target``), and every
  decode step runs inside the target's step gate, so a step never sees two versions. In
  ``swap`` mode on host memory the target serves straight from the transfer's buffer half (no
  copy on this side). At the first step after a new version committed, sequences in flight are
  either re-prefilled under the new weights (``ResumePolicy.RECOMPUTE``, the default) or keep
  the cache the old weights built (``KEEP_CACHE``), and ``Trajectory.resumed`` records which;
- with a LoRA adapter (``lora``) the model is wrapped by peft and the target holds the
  adapter's tensors only (unmerged, under the trainer's names): an update replaces the whole
  adapter, the base is never written, and until the commit the previous adapter serves;
- behaviour log-probs are those of the distribution each token was actually drawn from:
  ``log_softmax(logits / temperature)``, the quantity the train engine recomputes at the same
  temperature, renormalised over the tokens top-k/top-p kept when those filters are on (minus
  the log of the kept mass). So pi_prox / pi_behav is the true importance ratio of a truncated
  sampler too, never a full-vocabulary ratio that hides the truncation;
- sampling is a function of the request alone: each request draws from its own generator
  seeded by ``(seed, prompt_id, index)``, one uniform per token (inverse-CDF), so the tokens do
  not depend on which other requests share the batch (up to float rounding of batched
  matmuls, which would have to land on a CDF boundary to change a token).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from tandem.core.protocols import GenerationRequest
from tandem.core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from tandem.engines.shared.batching import Call, ContinuousBatcher, EngineClosedError
from tandem.engines.shared.lora import adapter_tensors, with_adapter
from tandem.engines.shared.probe import probe_logprobs
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.param_sync import LoadMode, ModuleTarget

if TYPE_CHECKING:
    import peft

__all__ = ["DecodeBatch", "DecodeRow", "EngineClosedError", "HFRolloutEngine", "validate_request"]


@dataclass(slots=True)
class DecodeRow:
    """A request from submission to delivery; mutated only by the decode thread."""

    request: GenerationRequest
    call: Call[DecodeRow]
    generator: torch.Generator
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    resumed: ResumePolicy | None = None
    # Set from the caller's thread when it stops listening; the decode thread drops the row at
    # the next step boundary (a plain bool: one late step is the worst a race can cost).
    cancelled: bool = False

    @property
    def cached_ids(self) -> list[int]:
        """The tokens the row's cache must hold: everything but the newest token."""
        return self.request.prompt_ids + self.response_ids[:-1]


@dataclass(slots=True)
class DecodeBatch:
    """In-flight rows and their KV cache; ``mask`` [rows, cache length] is 0 on left padding."""

    rows: list[DecodeRow]
    cache: DynamicCache
    mask: torch.Tensor


@dataclass(slots=True)
class _KeptCache:
    """A finished row's cache, kept for its sequence's next request: the tokens it holds and one
    (keys, values) pair per layer, each [1, heads, len(ids), head_dim]."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def _request_generator(request: GenerationRequest) -> torch.Generator:
    # Mixing prompt_id and index into the seed keeps the n samples of a group distinct even when
    # the caller passes one seed for all of them; SeedSequence decorrelates nearby integers.
    seed = np.random.SeedSequence([request.seed, request.prompt_id, request.index]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(seed))


def validate_request(request: GenerationRequest) -> None:
    """Refuse a request no rollout engine can serve, naming the field."""
    p = request.params
    if not request.prompt_ids:
        raise ValueError(f"request {request.prompt_id}/{request.index}: empty prompt")
    if p.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {p.max_new_tokens}")
    if p.temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy), got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {p.top_k}")


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _with_kv(cache: DynamicCache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """``cache`` holding ``kv`` (one (keys, values) pair per layer), set in place.

    Not ``DynamicCache(ddp_cache_data=kv)``: that appends each pair to an empty layer with
    ``torch.cat``, a second copy of the whole cache. Rows leave and join the batch at almost
    every decode step once generation runs well ahead of training (k >= 2), and that copy cost
    more than the decode forward itself (profiled: cache rebuilds ~40 % of the generation thread).
    """
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = keys, values
    return cache


def _select(batch: DecodeBatch, keep: list[int]) -> DecodeBatch | None:
    """Keep the rows at ``keep`` and trim left-padding columns no remaining row needs."""
    if not keep:
        return None
    mask = batch.mask
    kv = _kv(batch.cache)
    if len(keep) != len(batch.rows):
        index = torch.tensor(keep, device=mask.device)
        mask = mask.index_select(0, index)
        kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
    first = int(mask.any(dim=0).long().argmax())  # first column some row attends to
    if first == 0 and len(keep) == len(batch.rows):
        return batch
    if first > 0:
        mask = mask[:, first:]
        kv = [(k[:, :, first:], v[:, :, first:]) for k, v in kv]
    return DecodeBatch([batch.rows[i] for i in keep], _with_kv(batch.cache, kv), mask)


def _merge(blocks: list[DecodeBatch]) -> DecodeBatch:
    """Stack batches row-wise, left-padding each cache and mask to the longest."""
    if len(blocks) == 1:
        return blocks[0]
    length = max(b.mask.shape[1] for b in blocks)
    kvs, masks = [], []
    for b in blocks:
        pad = length - b.mask.shape[1]
        kvs.append([(F.pad(k, (0, 0, pad, 0)), F.pad(v, (0, 0, pad, 0))) for k, v in _kv(b.cache)])
        masks.append(F.pad(b.mask, (pad, 0)))
    kv = [
        (torch.cat([layers[i][0] for layers in kvs]), torch.cat([layers[i][1] for layers in kvs]))
        for i in range(len(kvs[0]))
    ]
    rows = [row for b in blocks for row in b.rows]
    return DecodeBatch(rows, _with_kv(blocks[0].cache, kv), torch.cat(masks))


class HFRolloutEngine(ContinuousBatcher[GenerationRequest, DecodeRow, "DecodeBatch | None"]):
    """Samples sequences from a transformers causal LM on one dedicated decode thread.

    Implements :class:`core.protocols.RolloutEngine`. Several concurrent ``generate()``
    calls share one continuous batch of at most ``max_batch_size`` rows. New weights reach it
    through ``target`` (a :class:`~param_sync.ModuleTarget` in ``load_mode``), fed by a
    param_sync :class:`~param_sync.Receiver`; with ``lora``, a peft adapter's tensors only.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        num_threads: int = 1,
        resume_policy: ResumePolicy | str = ResumePolicy.RECOMPUTE,
        load_mode: LoadMode = "swap",
        start_version: int = 0,
        lora: peft.LoraConfig | None = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, num_threads=num_threads)
        self._device = torch.device(device)
        self._resume_policy = ResumePolicy(resume_policy)

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self._device)
        self._model = (model if lora is None else with_adapter(model, lora)).eval().requires_grad_(False)
        # transformers renamed forward's ``past_key_values`` to ``cache`` (the old name warns on
        # every call and is removed in 5.40); older releases know only the old one.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # The batch cache is managed as plain per-layer tensors; sliding-window or linear
        # attention layers would need their own bookkeeping, so refuse them loudly.
        layer_types = {type(layer) for layer in DynamicCache(config=model.config).layers}
        if layer_types - {DynamicLayer}:
            raise NotImplementedError(f"{model_path}: cache layers {layer_types} are not supported")
        self._tokenizer = load_tokenizer(model_path)
        eos = model.generation_config.eos_token_id
        self._eos_ids: frozenset[int] = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        weights = None if lora is None else adapter_tensors(self._model)
        self.target = ModuleTarget(self._model, load_mode=load_mode, version=start_version, weights=weights)
        self._serving = start_version  # decode thread only: the version its last step decoded with
        self._kept: OrderedDict[tuple[int, int], _KeptCache] = OrderedDict()  # decode thread only
        self._start("hf-rollout")

    # ----------------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        """The weight version serving new tokens (committed into ``target``)."""
        return self.target.loaded_version

    @property
    def model(self) -> torch.nn.Module:
        """The served model, for inspection and hooks; change weights only through ``target``."""
        return self._model

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids[1:]`` at temperature 1 under the weights serving now (the
        sync's probe, ``engines.shared.probe``), computed on the caller's thread inside the step
        gate, so no update lands midway. Blocking; not from an event loop."""
        with self.target.decode_step():
            return probe_logprobs(self._model, token_ids)

    # ----------------------------------------------------------------------- the batching loop's hooks

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(request)

    def _new_row(self, request: GenerationRequest, call: Call[DecodeRow]) -> DecodeRow:
        return DecodeRow(request, call, _request_generator(request))

    def _empty(self) -> DecodeBatch | None:
        return None

    def _rows(self, batch: DecodeBatch | None) -> list[DecodeRow]:
        return batch.rows if batch is not None else []

    def _advance(self, batch: DecodeBatch | None, joining: list[DecodeRow]) -> DecodeBatch | None:
        if self.target.loaded_version != self._serving:  # an update committed since the last step
            self._serving = self.target.loaded_version
            self._kept.clear()  # built by the old weights
            batch = self._resume_in_flight(batch)
        if batch is not None:
            batch = _select(batch, [i for i, row in enumerate(batch.rows) if not row.cancelled])
        if joining:
            batch = self._admit(batch, joining)
        if batch is not None:
            batch = self._decode_step(batch)
        return batch

    def _take_waiting(self, free: int) -> list[DecodeRow]:
        """Waiting rows to join the batch now: none while a backlog could fill only a few free
        slots, so rows join in batches of at least a quarter of the width.

        Each join costs a prefill and a merge that copies the whole batch cache; with a backlog
        (generation well ahead of training) rows finish one or two per decode step, and joining
        them one by one spent more on prefills and merges than on decoding. Rows that all fit
        join at once, so a short queue (the tail of a step, a synchronous run) never waits.
        """
        if self._waiting and len(self._waiting) > free and free < max(1, self._max_batch_size // 4):
            return []
        return super()._take_waiting(free)

    def _prefill(self, rows: list[DecodeRow], token_lists: list[list[int]]) -> list[tuple[DecodeBatch, torch.Tensor]]:
        """Encode each row's tokens from scratch; rows of equal length share one padding-free forward.

        Returns one (batch, last-position logits) pair per length group.
        """
        groups: dict[int, list[int]] = {}
        for i, tokens in enumerate(token_lists):
            groups.setdefault(len(tokens), []).append(i)
        out = []
        for idx in groups.values():
            ids = torch.tensor([token_lists[i] for i in idx], device=self._device)
            cache = DynamicCache()
            logits = self._model(input_ids=ids, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1).logits
            mask = torch.ones(ids.shape, dtype=torch.long, device=self._device)
            out.append((DecodeBatch([rows[i] for i in idx], cache, mask), logits[:, -1]))
        return out

    def _extend(self, continued: list[tuple[DecodeRow, _KeptCache]]) -> list[tuple[DecodeBatch, torch.Tensor]]:
        """Encode only what each row's prompt adds to its kept cache; rows with equal kept and
        prompt lengths share one padding-free forward. Returns (batch, last-position logits) pairs."""
        groups: dict[tuple[int, int], list[tuple[DecodeRow, _KeptCache]]] = {}
        for row, kept in continued:
            groups.setdefault((len(kept.ids), len(row.request.prompt_ids)), []).append((row, kept))
        out = []
        for (cached, total), members in groups.items():
            kv = [
                (torch.cat([k for k, _ in layer]), torch.cat([v for _, v in layer]))
                for layer in zip(*(kept.kv for _, kept in members), strict=True)
            ]
            cache = DynamicCache(ddp_cache_data=kv)
            ids = torch.tensor([row.request.prompt_ids[cached:] for row, _ in members], device=self._device)
            logits = self._model(input_ids=ids, **{self._cache_arg: cache}, use_cache=True, logits_to_keep=1).logits
            mask = torch.ones((len(members), total), dtype=torch.long, device=self._device)
            out.append((DecodeBatch([row for row, _ in members], cache, mask), logits[:, -1]))
        return out

    def _admit(self, batch: DecodeBatch | None, joining: list[DecodeRow]) -> DecodeBatch | None:
        blocks = [] if batch is None else [batch]
        fresh: list[DecodeRow] = []
        continued: list[tuple[DecodeRow, _KeptCache]] = []
        for row in joining:
            kept = self._kept.pop((row.request.prompt_id, row.request.index), None)
            prompt = row.request.prompt_ids
            if kept is not None and len(prompt) > len(kept.ids) and prompt[: len(kept.ids)] == kept.ids:
                continued.append((row, kept))
            else:
                fresh.append(row)
        prefilled = self._prefill(fresh, [s.request.prompt_ids for s in fresh]) + self._extend(continued)
        for block, logits in prefilled:
            running = _select(block, self._append_tokens(block, logits))
            if running is not None:
                blocks.append(running)
        return _merge(blocks) if blocks else None

    def _decode_step(self, batch: DecodeBatch) -> DecodeBatch | None:
        rows = batch.rows
        input_ids = torch.tensor([[s.response_ids[-1]] for s in rows], device=self._device)
        positions = torch.tensor(
            [[len(s.request.prompt_ids) + len(s.response_ids) - 1] for s in rows], device=self._device
        )
        mask = F.pad(batch.mask, (0, 1), value=1)
        logits = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_arg: batch.cache},
            use_cache=True,
        ).logits[:, -1]
        batch.mask = mask
        return _select(batch, self._append_tokens(batch, logits))

    def _append_tokens(self, batch: DecodeBatch, logits: torch.Tensor) -> list[int]:
        """Sample one token per row, deliver the rows that finish (keeping the caches of those
        marked ``continued``), return the indices of the rest."""
        rows = batch.rows
        tokens, logprobs = self._sample(rows, logits)
        still_running = []
        for i, (seq, token, logprob) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            seq.response_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self._serving)
            reason = self._finish_reason(seq)
            if reason is None:
                still_running.append(i)
                continue
            if seq.request.continued and seq.resumed is not ResumePolicy.KEEP_CACHE:
                self._keep(batch, i)
            seq.call.deliver(self._to_trajectory(seq, reason))
        return still_running

    def _keep(self, batch: DecodeBatch, i: int) -> None:
        """Keep row ``i``'s cache (its own columns, copied out of the batch's tensors) for the
        sequence's next request, dropping the oldest kept one beyond ``max_batch_size``."""
        first = int(batch.mask[i].argmax())  # the row's first column: left padding before it
        kv = [(k[i : i + 1, :, first:].clone(), v[i : i + 1, :, first:].clone()) for k, v in _kv(batch.cache)]
        request = batch.rows[i].request
        self._kept[(request.prompt_id, request.index)] = _KeptCache(batch.rows[i].cached_ids, kv)
        while len(self._kept) > self._max_batch_size:
            self._kept.popitem(last=False)

    def _sample(self, rows: list[DecodeRow], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Inverse-CDF sampling over the top-k/top-p filtered, temperature-scaled distribution;
        returns each row's token and its log-prob under that (renormalised) distribution."""
        vocab = logits.shape[-1]
        params = [s.request.params for s in rows]
        temperature = torch.tensor([[p.temperature] for p in params], device=logits.device)
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
        # Sorted order makes both filters prefixes of each row (stable: ties in a fixed order).
        sorted_lp, order = logprobs.sort(dim=-1, descending=True, stable=True)
        probs = sorted_lp.exp()
        rank = torch.arange(vocab, device=logits.device)
        top_k = torch.tensor([[p.top_k or vocab] for p in params], device=logits.device)
        top_p = torch.tensor([[p.top_p] for p in params], device=logits.device)
        # Keep a token while the mass before it is below top_p: the token crossing top_p stays.
        keep = (rank < top_k) & (probs.cumsum(-1) - probs < top_p)
        cdf = (probs * keep).cumsum(-1)
        uniforms = torch.cat([torch.rand(1, generator=s.generator) for s in rows]).to(logits.device)
        target = uniforms.unsqueeze(1) * cdf[:, -1:]
        index = torch.searchsorted(cdf, target, right=True)
        index = torch.minimum(index, keep.sum(-1, keepdim=True) - 1)  # rounding at the top end
        # log(p / kept mass): 0 is subtracted when nothing is filtered (kept mass 1, up to rounding).
        kept = cdf[:, -1:]
        logprob = sorted_lp.gather(1, index) - torch.where(keep.all(-1, keepdim=True), 0.0, kept.log())
        return order.gather(1, index).squeeze(1).tolist(), logprob.squeeze(1).tolist()

    def _finish_reason(self, seq: DecodeRow) -> FinishReason | None:
        params = seq.request.params
        if seq.response_ids[-1] in self._eos_ids:
            return FinishReason.STOP
        if params.stop:
            text = self._tokenizer.decode(seq.response_ids, skip_special_tokens=True)
            if any(stop in text for stop in params.stop):
                return FinishReason.STOP
        if len(seq.response_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _to_trajectory(self, seq: DecodeRow, reason: FinishReason) -> Trajectory:
        request = seq.request
        return token_trajectory(
            request.prompt_id, request.index, list(request.prompt_ids), seq.response_ids, seq.logprobs, seq.versions,
            reason, text=self._tokenizer.decode(seq.response_ids, skip_special_tokens=True), resumed=seq.resumed,
        )

    def _resume_in_flight(self, batch: DecodeBatch | None) -> DecodeBatch | None:
        """After a weight change: mark the in-flight rows and, under RECOMPUTE, rebuild their cache."""
        if batch is None:
            return None
        for seq in batch.rows:
            seq.resumed = self._resume_policy
        if self._resume_policy is ResumePolicy.KEEP_CACHE:
            return batch
        rows = batch.rows
        return _merge([block for block, _ in self._prefill(rows, [s.cached_ids for s in rows])])
