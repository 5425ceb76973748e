"""Decoding: prefill the prompts through the ops, then O(1) steps, the whole loop in one ``jax.jit``.

    logits, cache = prefill(model, prompt, prompt_lengths)     (chunked / Pallas ops, final states)
    y_1 = sample(logits);  y_{i+1} = sample(model.step(y_i, cache))   (``lax.while_loop``)

sample: argmax when temperature == 0 (greedy), else a draw from softmax(logits / temperature),
restricted to the top_k largest logits when top_k is given.

EOS: once row b has emitted ``eos_id`` its later tokens are ``pad_id`` (y_{i+1} = pad when
done_i, done_{i+1} = done_i ∨ y_{i+1} = eos); the loop ends when every row is done or after
``max_new_tokens`` tokens, and the output is [B, max_new_tokens] either way.

Ragged prompts (right-padded, row b's real tokens are prompt[b, :l_b]): every row becomes two
documents packed along one sequence with ``cu_seqlens``, its real tokens and the rest of the row
(T + 1 − l_b ≥ 1 tokens: one extra pad column keeps that document non-empty). The ops restart
every state at each document (memory S, OSGM's d from d_1, ATK's A from 0, the conv window from
zeros) and return each document's final state, so a row's cache is exactly its real tokens' cache,
for all twelve variants, with no masking inside the layers.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precond_linattn._typing import Array, Int
from precond_linattn.models.lm import LanguageModel


def sample(logits, key, temperature, top_k: int | None, *, greedy: bool):
    """Next tokens [B] from logits [B, vocab]: the argmax when ``greedy``, else a draw at
    ``temperature`` (> 0, may be traced) among the ``top_k`` largest logits (all when None)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prefill(model: LanguageModel, prompt: Int[Array, "b t"], prompt_lengths=None):
    """(logits [B, vocab] after each row's last real token, the decode cache of B rows).

    ``prompt_lengths`` [B] (1 ≤ l_b ≤ T): row b's prompt is prompt[b, :l_b], the rest is
    ignored; None: every row is T tokens long (the plain batched prefill). Ragged rows run as
    2B packed documents [prompt[b, :l_b]], [the rest of row b, one pad] (module docstring)."""
    if prompt_lengths is None:
        return model.prefill(prompt)
    B, T = prompt.shape
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    real = jnp.arange(T + 1) < lengths[:, None]
    packed = jnp.where(real, jnp.pad(prompt, ((0, 0), (0, 1))), 0).reshape(1, B * (T + 1))
    starts = jnp.arange(B, dtype=jnp.int32) * (T + 1)
    cu = jnp.append(jnp.stack([starts, starts + lengths], 1).reshape(-1), B * (T + 1))
    logits, cache = model.prefill(packed, cu_seqlens=cu)
    return logits[0::2], jax.tree.map(lambda x: x[0::2], cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k"))
def _generate(graphdef, state, prompt, prompt_lengths, rng, temperature, eos_id, pad_id, *,
              max_new_tokens, greedy, top_k):
    model = nnx.merge(graphdef, state)
    logits, cache = prefill(model, prompt, prompt_lengths)
    keys = jax.random.split(rng, max_new_tokens)

    def emit(logits, key, done):
        token = jnp.where(done, pad_id, sample(logits, key, temperature, top_k, greedy=greedy))
        return token, done | (token == eos_id)

    first, done = emit(logits, keys[0], jnp.zeros(prompt.shape[:1], bool))
    out = jnp.full((prompt.shape[0], max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)

    def running(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, done, out = carry
        logits, cache = model.step(token, cache)
        token, done = emit(logits, keys[i], done)
        return i + 1, token, cache, done, out.at[:, i].set(token)

    return jax.lax.while_loop(running, body, (1, first, cache, done, out))[-1]


def _check_token(name: str, value, vocab_size: int, *, optional: bool) -> None:
    if optional and value is None:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < vocab_size:
        allowed = "None or an int" if optional else "an int"
        raise ValueError(f"{name} must be {allowed} in [0, vocab_size={vocab_size}), got {value!r}")


def _check_prompt_lengths(prompt_lengths, batch: int, length: int) -> None:
    if prompt_lengths is None:
        return
    concrete = not isinstance(prompt_lengths, jax.core.Tracer)
    lengths = np.asarray(prompt_lengths) if concrete else prompt_lengths
    if lengths.shape != (batch,) or not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise ValueError(f"prompt_lengths must be an int array [B] = ({batch},), got shape "
                         f"{lengths.shape} and dtype {lengths.dtype}")
    if concrete and (lengths.min() < 1 or lengths.max() > length):
        raise ValueError(f"prompt_lengths must lie in [1, T={length}], got {lengths.tolist()}")


def generate(model: LanguageModel, prompt: Int[Array, "b t"], max_new_tokens: int, *,
             prompt_lengths=None, eos_id: int | None = None, pad_id: int = 0, rng=None,
             temperature: float = 0.0, top_k: int | None = None) -> Int[Array, "b n"]:
    """The ``max_new_tokens`` tokens that follow ``prompt`` [B, T] (T >= 1), [B, max_new_tokens].

    prompt_lengths: [B] ints in [1, T] for right-padded prompts (row b continues after
      prompt[b, l_b − 1]); None: every row is T tokens long.
    eos_id: after a row emits it, the row's later tokens are ``pad_id``; the loop stops early once
      every row has (inside the jit). None: no end token.
    Greedy with temperature 0 (the default), else sampling with ``rng`` (a PRNG key; required).
    Compiled once per (model structure, prompt shape, ragged or not, max_new_tokens, greedy or
    not, top_k); eos_id and pad_id are traced."""
    if not hasattr(prompt, "ndim") or prompt.ndim != 2 or prompt.shape[1] < 1:
        shape = getattr(prompt, "shape", prompt)
        raise ValueError(f"prompt must be an int array [B, T] with T >= 1, got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    vocab = model.config.vocab_size
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size], got {top_k!r}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng, a PRNG key")
    _check_prompt_lengths(prompt_lengths, *prompt.shape)
    _check_token("eos_id", eos_id, vocab, optional=True)
    _check_token("pad_id", pad_id, vocab, optional=False)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32),
                     None if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32),
                     rng, jnp.float32(temperature), jnp.int32(-1 if eos_id is None else eos_id),
                     jnp.int32(pad_id), max_new_tokens=max_new_tokens, greedy=temperature == 0,
                     top_k=top_k)
