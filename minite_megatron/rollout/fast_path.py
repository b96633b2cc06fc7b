"""The rollout engine's fast path: batched prefill, then CUDA-graph decode steps on the device.

For a batch of ``B`` prompts (mixed lengths, right-padded to the longest, ``L``):

1. **prefill**: the learner's own forward over ``[B, L]`` (:meth:`.decode_step.DecodeModel.prefill`)
   fills the static KV cache and gives the prompt log-probs and the logits that sample each
   row's first token (at its own last prompt position);
2. **decode**: ``max_new_tokens - 1`` steps of :meth:`DecodeModel.step` for all rows, each at its
   own position, followed on the device by sampling (:mod:`.sampling`), the token's log-prob
   (:func:`.logprobs.token_logprobs`, the learner's function), the EOD done mask (a finished row
   keeps emitting EOD), and the bookkeeping of the static buffers. On a GPU each step is one
   replay of a CUDA graph captured per batch bucket (the next power of two, padding rows marked
   done) and sampling settings (:mod:`.cuda_graphs`); nothing syncs with the host except an
   all-done check every ``CHECK_EVERY`` steps. On a CPU the same step runs eagerly on ``B`` rows.

The sampling generator lives on the model's device; ``seed`` reseeds it per ``generate`` call,
so the same call gives the same rollouts (on one device: the CPU's and the GPU's noise differ).
Rows finish at EOD (``stop_at_eod``) or after ``max_new_tokens``.
"""

from __future__ import annotations

import logging

import torch

from .cuda_graphs import StepGraphs
from .decode_step import DecodeModel, KVCache
from .logprobs import CHUNK_BYTES, token_logprobs
from .rollout import Rollout
from .sampling import SamplingConfig, nonfinite_rows, sample_tokens

log = logging.getLogger(__name__)

PADDING_SEQ_ID = 1 << 25
"""Sequence ids a diagnostics tracer sees for the prefill's padding positions (beyond any real id)."""

CHECK_EVERY = 16
"""Decode steps between two host checks of "every row is done" (one sync each)."""


def buckets_for(max_batch_size: int) -> list[int]:
    """Batch buckets of the captured graphs: powers of two below ``max_batch_size``, and it."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


def kv_cache_bytes(num_layers: int, max_seq: int, max_batch: int, groups: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes of the static KV cache (keys and values of every layer, ``[S, B, ng, hn]`` each)."""
    return 2 * num_layers * max_seq * max_batch * groups * head_dim * torch.empty((), dtype=dtype).element_size()


def check_kv_cache_fits(nbytes: int, free: int, *, max_batch: int, max_seq: int, num_layers: int,
                        reserve: int) -> None:
    """Raise ValueError (one line: batch, length, bytes needed and free) when a KV cache of
    ``nbytes`` plus ``reserve`` (the decode step's working memory) exceeds ``free`` bytes."""
    if nbytes + reserve > free:
        raise ValueError(
            f"rollout: a KV cache of max_batch_size {max_batch} x max_sequence_length {max_seq} ({num_layers} layers) "
            f"needs {nbytes / 2**30:.2f} GiB (+ {reserve / 2**30:.2f} GiB working memory) but "
            f"{free / 2**30:.2f} GiB of device memory are free: lower max_batch_size or max_sequence_length")


def max_kv_batch(free: int, *, num_layers: int, max_seq: int, groups: int, head_dim: int, dtype: torch.dtype,
                 reserve: int) -> int:
    """The largest batch whose KV cache of ``max_seq`` tokens fits ``free - reserve`` bytes (0: none)."""
    one = kv_cache_bytes(num_layers, max_seq, 1, groups, head_dim, dtype)
    return max(0, (free - reserve) // one)


def step_reserve(max_batch: int, vocab: int, hidden: int) -> int:
    """Working memory one decode step (or its graph pool) is given room for: the logits and
    sampling buffers (fp32 ``[B, V]`` a few times) and the activations, with 1 GiB of slack."""
    return 6 * 4 * max_batch * vocab + 64 * max_batch * hidden * 4 + (1 << 30)


def prefill_bytes(batch: int, length: int, vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Working memory of one prefill over ``[batch, length]`` prompts: the ``[B, L, V]`` logits
    twice (the output layer's ``[L, B, V]`` and the model's ``[B, L, V]`` copy), the log-probs'
    fp32 blocks (:data:`.logprobs.CHUNK_BYTES`, input and output), the activations (32 of
    ``[B*L, H]``), and 1 GiB of slack."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * batch * length * vocab * elt + 3 * CHUNK_BYTES + 32 * batch * length * hidden * elt + (1 << 30)


def check_prefill_fits(nbytes: int, free: int, *, batch: int, length: int) -> None:
    """Raise ValueError (one line) when a prefill's working memory ``nbytes`` exceeds ``free``."""
    if nbytes > free:
        raise ValueError(
            f"rollout: a prefill of {batch} prompts x {length} tokens needs {nbytes / 2**30:.2f} GiB of working "
            f"memory (logits, log-probs, activations) but {free / 2**30:.2f} GiB of device memory are free "
            "(after the weights and the KV cache): pass fewer or shorter prompts per generate call")


def device_free(device) -> int:
    """Bytes a new allocation on ``device`` can get: the driver's free memory plus what PyTorch's
    caching allocator holds unused."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class DecodeState:
    """The static buffers one decode step reads and writes (``max_batch`` rows)."""

    def __init__(self, max_batch: int, max_seq: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.done = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.bad = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, **long)
        self.out_tokens = torch.zeros(max_batch, max_seq, **long)
        self.out_logprobs = torch.zeros(max_batch, max_seq, dtype=torch.float32, device=device)


class FastGenerator:
    """Batches of rollouts on the decode runner (see the module docstring).

    Args:
        model: the learner's ``GPTModel`` (or a wrapper); :func:`.support.fast_path_refusal` is None.
        use_graphs: capture the decode step in CUDA graphs (needs a GPU).
        attention / invariant_gemm / fused_kernels / kernels_on_cpu: :class:`~.decode_step.DecodeModel`'s options.
    """

    def __init__(self, model, *, eod_id: int, vocab_size: int, max_batch_size: int, max_sequence_length: int,
                 strict: bool, use_graphs: bool, attention: str = "module", invariant_gemm: bool = False,
                 fused_kernels: bool = True, kernels_on_cpu: bool = False):
        self.runner = DecodeModel(model, attention=attention, invariant_gemm=invariant_gemm,
                                  fused_kernels=fused_kernels, kernels_on_cpu=kernels_on_cpu)
        self.eod_id, self.vocab_size, self.strict = eod_id, vocab_size, strict
        self.max_batch_size, self.max_seq = max_batch_size, max_sequence_length
        gpt = self.runner.gpt
        param = gpt.embedding.word_embeddings.weight
        self.device = param.device
        self.use_graphs = use_graphs
        self.generator = torch.Generator(device=self.device)
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            check_kv_cache_fits(
                kv_cache_bytes(self.runner.num_layers, max_sequence_length, max_batch_size, self.runner.groups,
                               self.runner.head_dim, param.dtype), free,
                max_batch=max_batch_size, max_seq=max_sequence_length, num_layers=self.runner.num_layers,
                reserve=step_reserve(max_batch_size, vocab_size, param.shape[-1]))
        self.cache = KVCache(self.runner.num_layers, max_sequence_length, max_batch_size, self.runner.groups,
                             self.runner.head_dim, param.dtype, self.device)
        self.state = DecodeState(max_batch_size, max_sequence_length, self.device)
        self.buckets = buckets_for(max_batch_size)
        self.graphs = StepGraphs(self.generator, self.runner.capturing) if use_graphs else None
        self._layout = None
        self.last_timing: dict = {}  # GPU: prefill_ms, decode_ms, decode_steps of the last batch

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    # ---- weights ------------------------------------------------------------------------------
    def _param_layout(self) -> tuple:
        return tuple((p.data_ptr(), p.dtype, tuple(p.shape)) for p in self.runner.gpt.parameters())

    def sync_weights(self) -> None:
        """Copy new weight versions into the decode buffers; drop the graphs if a parameter moved."""
        self.runner.refresh_weights()
        layout = self._param_layout()
        if self._layout is not None and layout != self._layout and self.graphs is not None:
            self.graphs.clear()
        self._layout = layout

    # ---- one batch ----------------------------------------------------------------------------
    def _body(self, rows: int, cfg: SamplingConfig, fire_hooks: bool = False):
        st, eod = self.state, self.eod_id

        def body():
            tok, pos, done = st.tokens[:rows], st.positions[:rows], st.done[:rows]
            logits = self.runner.step(tok, pos, self.cache, fire_hooks)
            nxt = sample_tokens(logits, cfg, self.generator, self.vocab_size)
            nxt = torch.where(done, eod, nxt)
            lp = token_logprobs(logits, nxt, self.strict, cfg.logprob_temperature, check=False)
            st.bad[:rows] |= nonfinite_rows(logits)
            st.out_tokens[:rows].index_copy_(1, st.step, nxt.view(rows, 1))
            st.out_logprobs[:rows].index_copy_(1, st.step, lp.view(rows, 1))
            if cfg.stop_at_eod:
                done |= nxt == eod
            tok.copy_(nxt)
            pos += 1
            st.step += 1

        return body

    def _reset_scratch(self, rows: int):
        st = self.state

        def reset():
            st.tokens[:rows].fill_(self.eod_id)
            st.positions[:rows].zero_()
            st.done[:rows].zero_()
            st.step.zero_()

        return reset

    def generate_batch(self, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                       stop_at_eod: bool, logprob_temperature: float, seq_offset: int = 0,
                       tracer=None) -> list[Rollout]:
        b = len(prompts)
        cfg = SamplingConfig(float(temperature), int(top_k), float(top_p), float(logprob_temperature), bool(stop_at_eod))
        graphed = self.graphs is not None and tracer is None
        rows = next(x for x in self.buckets if x >= b) if graphed else b
        graph = None
        if graphed and max_new_tokens > 1:
            try:
                graph = self.graphs.get((rows, cfg), self._body(rows, cfg), self._reset_scratch(rows))
            except Exception as e:  # an op that cannot be captured: say so, run the same steps eagerly
                log.warning("rollout: CUDA-graph capture of the decode step failed (%s: %s); decode steps run eagerly",
                            type(e).__name__, e)
                self.graphs, self.use_graphs, graphed, rows = None, False, False, b
                torch.cuda.synchronize()
        st, dev = self.state, self.device
        lengths = torch.tensor([len(p) for p in prompts])
        longest = int(lengths.max())
        grid = torch.full((b, longest), self.eod_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            grid[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        grid, lengths_dev = grid.to(dev), lengths.to(dev)

        if dev.type == "cuda":
            check_prefill_fits(prefill_bytes(b, longest, self.vocab_size, self.runner.gpt.embedding.word_embeddings.weight.shape[-1],
                                             self.runner.gpt.embedding.word_embeddings.weight.dtype),
                               device_free(dev), batch=b, length=longest)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if dev.type == "cuda" else None
        if events:
            events[0].record()
        # prefill: the learner's forward over the prompts, filling the cache in the bucket's layout
        self.cache.reset()
        if tracer is not None:  # prompt padding gets sequence ids of its own (never a real token's key)
            pos = torch.arange(longest).view(-1, 1)
            seq = torch.where(pos < lengths.view(1, b), torch.arange(b).view(1, b) + seq_offset,
                              torch.arange(b).view(1, b) + PADDING_SEQ_ID)
            tracer.set_tokens(seq, pos)
        logits = self.runner.prefill(grid, self.cache, rows)
        prompt_lp = token_logprobs(logits[:, :-1], grid[:, 1:], self.strict, cfg.logprob_temperature, check=False)
        last = logits[torch.arange(b, device=dev), lengths_dev - 1]
        del logits
        first = sample_tokens(last, cfg, self.generator, self.vocab_size)
        first_lp = token_logprobs(last, first, self.strict, cfg.logprob_temperature, check=False)

        st.tokens[:rows].fill_(self.eod_id)
        st.positions[:rows].zero_()
        st.done[:rows].fill_(True)
        st.bad[:rows] = nonfinite_rows(torch.nn.functional.pad(last, (0, 0, 0, rows - b)))
        st.step.fill_(1)
        st.tokens[:b] = first
        st.positions[:b] = lengths_dev
        st.done[:b] = (first == self.eod_id) if stop_at_eod else False
        st.out_tokens[:b, 0] = first
        st.out_logprobs[:b, 0] = first_lp

        if events:
            events[1].record()
        steps = 1
        body = None if graph is not None else self._body(rows, cfg, fire_hooks=tracer is not None)
        while steps < max_new_tokens:
            if steps % CHECK_EVERY == 0 and stop_at_eod and bool(st.done[:b].all()):
                break
            if graph is not None:
                graph.replay()
            else:
                if tracer is not None:
                    tracer.set_tokens(torch.arange(b).view(1, b) + seq_offset, st.positions[:b].cpu().view(1, b))
                body()
            steps += 1

        if events:
            events[2].record()
            events[2].synchronize()
            self.last_timing = {"prefill_ms": events[0].elapsed_time(events[1]),
                                "decode_ms": events[1].elapsed_time(events[2]), "decode_steps": steps - 1,
                                "rows": rows, "graphed": graph is not None}
        if bool(st.bad[:b].any()):
            bad = st.bad[:b].nonzero().reshape(-1).tolist()
            raise RuntimeError(f"rollout: non-finite logits (NaN or +inf) in batch rows {bad}; the model's "
                               "weights or activations are not finite")
        toks = st.out_tokens[:b, :steps].cpu()
        lps = st.out_logprobs[:b, :steps].cpu()
        prompt_lp = prompt_lp.float().cpu()
        out = []
        for i, p in enumerate(prompts):
            gen = toks[i].tolist()
            eod = stop_at_eod and self.eod_id in gen
            n = gen.index(self.eod_id) + 1 if eod else steps
            out.append(Rollout(list(p), gen[:n], prompt_lp[i, : len(p) - 1].clone(), lps[i, :n].clone(), bool(eod)))
        return out
