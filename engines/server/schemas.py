"""Pydantic models of the HTTP bodies a rollout server and its clients exchange.

What it owns: the request and response schemas of sglang's native API for the calls an RL
trainer makes, with sglang's field names and defaults (read from ``sglang/srt/managers/io_struct.py``,
``sglang/srt/sampling/sampling_params.py`` and ``sglang/srt/entrypoints/http_server.py``), the
OpenAI-compatible completion bodies (``sglang/srt/entrypoints/openai/protocol.py``), and tandem's
few extensions, each marked as such:

- ``meta_info.output_token_versions``: the policy version of every output token (a real sglang
  server lacks it; the client then derives versions from the weight updates it made) and
  ``meta_info.resumed`` (the resume policy applied when weights changed mid-sequence);
- ``UpdateWeightsFromDistributedReqInput.bucket_nbytes``: when set, the trainer broadcasts one
  more tensor after the weights, the checksum of every bucket of the transfer (a real server
  ignores the field and so is never sent the extra tensor, see ``engines.server.weights``);
- the shared-memory weight update (``/tandem/update_weights_from_shm``), the conversation
  records of the OpenAI endpoint (``/tandem/conversations/{id}``) and the weight probe's
  scoring (``/tandem/probe_logprobs``), which sglang has no counterpart for.

Invariants: requests are parsed with ``extra="forbid"``, so a field this server does not
implement is refused with a 400 naming it rather than silently ignored; responses allow extra
fields, so a client reads a real sglang server's answers (which carry many more) unchanged.
Every number a request carries is finite and in its range, and every token id within the
vocabulary, before anything reaches the engine: the server validates with a context
(:func:`request_context`: ``vocab_size``, ``max_top_logprobs``) and a 400 names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from tandem.param_sync.bucket import BucketHeader, Manifest, TensorMeta

__all__ = [
    "AbortReq",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ConversationRecord",
    "FinishReason",
    "GenerateReqInput",
    "GenerateResponse",
    "InitWeightsUpdateGroupReqInput",
    "LoRAUpdateResult",
    "LoadLoRAAdapterReqInput",
    "LoadReportBody",
    "MetaInfo",
    "ModelInfo",
    "PauseGenerationReqInput",
    "ProbeReqInput",
    "ProbeResponse",
    "SamplingParams",
    "ShmMessage",
    "SuccessResponse",
    "UnloadLoRAAdapterReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput",
    "manifest_from_json",
    "manifest_to_json",
    "request_context",
]

MAX_SEED = (1 << 63) - 1


def request_context(vocab_size: int, max_top_logprobs: int) -> dict[str, int]:
    """What validating a request needs to know of the server it goes to."""
    return {"vocab_size": vocab_size, "max_top_logprobs": max_top_logprobs}


def check_token_ids(ids: list[int], field: str, info: ValidationInfo) -> None:
    """Every id in ``ids`` within the vocabulary (when the context gives its size); ``field`` names them."""
    vocab = (info.context or {}).get("vocab_size")
    if not ids:
        raise ValueError(f"{field}: a prompt needs at least one token")
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab if vocab is not None else 'vocab'})")


def check_top_k(top_k: int | None, field: str, info: ValidationInfo) -> None:
    vocab = (info.context or {}).get("vocab_size")
    if top_k is not None and vocab is not None and top_k > vocab:
        raise ValueError(f"{field} must be -1 (disable) or in [1, {vocab}] (the vocabulary), got {top_k}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- /generate


class SamplingParams(_Request):
    """sglang's ``SamplingParams`` (the API fields an RL trainer sets). ``top_k = -1`` disables
    top-k as in sglang; ``temperature = 0`` is greedy (sglang turns it into ``top_k = 1``)."""

    max_new_tokens: int | None = Field(128, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)

    @model_validator(mode="after")
    def _supported(self, info: ValidationInfo) -> SamplingParams:
        if self.min_p != 0.0:
            raise ValueError("sampling_params.min_p: only 0 is supported by this server")
        if self.ignore_eos:
            raise ValueError("sampling_params.ignore_eos: not supported by this server")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (disable) or at least 1, got {self.top_k}")
        check_top_k(self.top_k, "sampling_params.top_k", info)
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if self.n < 1:
            raise ValueError(f"sampling_params.n must be >= 1, got {self.n}")
        return self


class GenerateReqInput(_Request):
    """sglang's ``GenerateReqInput`` (io_struct.py), the fields an RL trainer sends: one prompt
    (``input_ids: list[int]`` or ``text: str``) or a batch (lists of them)."""

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    conversation_id: str | None = None
    # The adapter to generate with, by its ``lora_name`` (per prompt in a batch). This server has
    # one adapter slot, which every request uses: a name must be the loaded one; None is the slot
    # as it is (sglang's None is the bare base).
    lora_path: str | list[str | None] | None = None

    @model_validator(mode="after")
    def _one_input(self, info: ValidationInfo) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text: an empty batch")
        if self.input_ids is not None:
            batch = [self.input_ids] if isinstance(self.input_ids[0], int) else self.input_ids
            for i, ids in enumerate(batch):
                check_token_ids(ids, "input_ids" if batch is not self.input_ids else f"input_ids[{i}]", info)  # type: ignore[arg-type]
        for name in ("logprob_start_len", "top_logprobs_num"):
            values = getattr(self, name)
            allowed = -1 if name == "logprob_start_len" else 0
            if values is not None and any(v != allowed for v in (values if isinstance(values, list) else [values])):
                raise ValueError(f"{name}: only {allowed} (output tokens only, no top logprobs) is supported by this server")
        return self


class FinishReason(_Response):
    """sglang's finish reason as JSON: ``stop`` (``matched``: the eos id or stop string),
    ``length`` (``length``: tokens generated), ``abort`` (``message``)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(_Response):
    """``meta_info`` of a /generate answer, as sglang's tokenizer manager builds it."""

    id: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str | None = None
    e2e_latency: float | None = None
    # [logprob, token_id, text or None] per output token, with return_logprob.
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    # tandem extension: the policy version of each output token, and the resume policy applied
    # when the weights changed under the sequence ("recompute", "keep_cache" or None).
    output_token_versions: list[int] | None = None
    resumed: str | None = None


class GenerateResponse(_Response):
    """One /generate answer (a batch request answers with a list of these)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


# ---------------------------------------------------------------------- control endpoints


class AbortReq(_Request):
    """sglang's ``AbortReq``: abort one request by ``rid`` (prefix match), or all of them."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


class PauseGenerationReqInput(_Request):
    """sglang's ``PauseGenerationReqInput``: ``abort`` ends every request in flight (each answers
    with its partial output and finish reason ``abort``); ``in_place`` freezes them with their
    cache until ``/continue_generation``. New requests wait while paused in either mode."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class SuccessResponse(_Response):
    """The ``{"success", "message"}`` body of sglang's weight-update endpoints."""

    success: bool
    message: str = ""
    num_paused_requests: int | None = None


class ModelInfo(_Response):
    """/get_model_info. ``tandem`` (an extension) is present on tandem's own server: its
    capabilities (``live_weight_updates``: weights change between decode steps without a
    pause, and output tokens carry versions)."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None
    tandem: dict[str, Any] | None = None


# ------------------------------------------------------------------------ weight updates


class UpdateWeightFromDiskReqInput(_Request):
    """sglang's ``UpdateWeightFromDiskReqInput``: load the checkpoint folder ``model_path``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorReqInput(_Request):
    """sglang's ``UpdateWeightsFromTensorReqInput`` (CUDA IPC handles of a colocated trainer).
    Parsed so the endpoint answers in sglang's format; tandem's server has no GPU IPC path and
    answers ``success: false`` (same-host updates use ``/tandem/update_weights_from_shm``)."""

    serialized_named_tensors: list[str | bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupReqInput(_Request):
    """sglang's ``InitWeightsUpdateGroupReqInput``: join a torch.distributed group whose rank 0
    (the trainer) hosts the rendezvous at ``master_address:master_port``; this server is rank
    ``rank_offset``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(_Request):
    """sglang's ``UpdateWeightsFromDistributedReqInput``: rank 0 broadcasts each named tensor,
    in order, in group ``group_name``. ``bucket_nbytes`` is tandem's extension (see above)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    bucket_nbytes: int | None = None

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class LoadLoRAAdapterReqInput(_Request):
    """sglang's ``LoadLoRAAdapterReqInput`` (``/load_lora_adapter``): the peft folder
    ``lora_path`` (``adapter_config.json``, ``adapter_model.safetensors``) under the name ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRAAdapterReqInput(_Request):
    """sglang's ``UnloadLoRAAdapterReqInput`` (``/unload_lora_adapter``)."""

    lora_name: str = Field(min_length=1)


class LoRAUpdateResult(_Response):
    """sglang's answer to both adapter routes: ``loaded_adapters`` maps each loaded name to its path."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] = Field(default_factory=dict)


class ProbeReqInput(_Request):
    """tandem's extension (``/tandem/probe_logprobs``): the weight probe's token sequence, scored
    at temperature 1 under the weights serving now (``engines.shared.probe``)."""

    input_ids: list[int] = Field(min_length=2)

    @model_validator(mode="after")
    def _in_vocabulary(self, info: ValidationInfo) -> ProbeReqInput:
        check_token_ids(self.input_ids, "input_ids", info)
        return self


class ProbeResponse(_Response):
    """The log-probs of ``input_ids[1:]``, by the server ``name`` serving ``weight_version``."""

    name: str
    weight_version: int
    logprobs: list[float]


class ShmMessage(_Request):
    """One line of the NDJSON body of ``/tandem/update_weights_from_shm``: ``begin`` (the
    segment and the manifest), one ``bucket`` per bucket as the gather finishes it, then
    ``end`` or ``abort``. The answer is the server's :class:`LoadReportBody`."""

    type: Literal["begin", "bucket", "end", "abort"]
    # a POSIX shared-memory name: no slash, so it cannot reach beyond /dev/shm
    segment: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,200}$")
    manifest: dict[str, Any] | None = None
    header: dict[str, int] | None = None
    reason: str = ""

    @model_validator(mode="after")
    def _complete(self) -> ShmMessage:
        needed = {"begin": ("segment", "manifest"), "bucket": ("header",)}.get(self.type, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required in a {self.type!r} message")
        return self


class LoadReportBody(_Response):
    """``param_sync.LoadReport`` as JSON."""

    engine: str
    version: int
    ok: bool
    error: str = ""
    verify_s: float = 0.0
    load_s: float = 0.0
    stall_s: float = 0.0


def manifest_to_json(manifest: Manifest) -> dict[str, Any]:
    return {
        "version": manifest.version,
        "total_nbytes": manifest.total_nbytes,
        "bucket_nbytes": manifest.bucket_nbytes,
        "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in manifest.tensors],
    }


def manifest_from_json(data: dict[str, Any]) -> Manifest:
    tensors = tuple(TensorMeta(n, dtype, tuple(shape), offset, nbytes) for n, dtype, shape, offset, nbytes in data["tensors"])
    return Manifest(int(data["version"]), tensors, int(data["total_nbytes"]), int(data["bucket_nbytes"]))


def header_to_json(header: BucketHeader) -> dict[str, int]:
    return {"version": header.version, "seq": header.seq, "count": header.count, "offset": header.offset,
            "nbytes": header.nbytes, "checksum": header.checksum}


def header_from_json(data: dict[str, int]) -> BucketHeader:
    return BucketHeader(**{k: int(v) for k, v in data.items()})


# ------------------------------------------------------------------- OpenAI-compatible API


class ChatMessage(_Response):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class _OpenAIRequest(BaseModel):
    # The openai client sends fields this server does not use (user, metadata...): ignored, as
    # sglang's protocol models do, except those that would change the sampling (checked below).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0)
    stream: bool = False
    # tandem's record key (sglang's GenerateReqInput has the same field): pass it with the
    # openai client's ``extra_body``, or as the ``X-Conversation-Id`` header.
    conversation_id: str | None = None

    @model_validator(mode="after")
    def _supported(self, info: ValidationInfo) -> _OpenAIRequest:
        if self.n != 1:
            raise ValueError("n: only 1 is supported by this server")
        if self.stream:
            raise ValueError("stream: streaming OpenAI responses are not supported by this server")
        if self.top_k is not None and (self.top_k == 0 or self.top_k < -1):
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        check_top_k(self.top_k, "top_k", info)
        cap = (info.context or {}).get("max_top_logprobs")
        for name in ("logprobs", "top_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or value is None:
                continue
            if value < 0 or (cap is not None and value > cap):
                raise ValueError(f"{name} must be in [0, {cap}] (the server's --max-top-logprobs), got {value}")
        return self


class CompletionRequest(_OpenAIRequest):
    """``/v1/completions``: ``prompt`` as text or token ids."""

    prompt: str | list[int]
    echo: bool = False

    @model_validator(mode="after")
    def _in_vocabulary(self, info: ValidationInfo) -> CompletionRequest:
        if isinstance(self.prompt, list):
            check_token_ids(self.prompt, "prompt", info)
        return self


class ChatCompletionRequest(_OpenAIRequest):
    """``/v1/chat/completions``: rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)


class ConversationRecord(_Response):
    """What one OpenAI request generated, exactly: the token ids it was given and produced,
    each output token's log-prob and policy version. A workflow builds trajectories from a
    conversation's records (``engines.server.agent``)."""

    conversation_id: str
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    resumed: str | None = None
