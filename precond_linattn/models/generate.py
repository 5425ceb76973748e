"""Decoding: prefill the prompt through the ops, then O(1) steps, the whole loop in one ``jax.jit``.

    logits, cache = model.prefill(prompt)              (chunked / Pallas ops, final states)
    y_1 = sample(logits);  y_{i+1} = sample(model.step(y_i, cache))   (``lax.scan``)

sample: argmax when temperature == 0 (greedy), else a draw from softmax(logits / temperature),
restricted to the top_k largest logits when top_k is given.
"""

import functools

import jax
import jax.numpy as jnp
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


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k"))
def _generate(graphdef, state, prompt, rng, temperature, *, max_new_tokens, greedy, top_k):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(prompt)
    keys = jax.random.split(rng, max_new_tokens)
    first = sample(logits, keys[0], temperature, top_k, greedy=greedy)

    def body(carry, key):
        token, cache = carry
        logits, cache = model.step(token, cache)
        token = sample(logits, key, temperature, top_k, greedy=greedy)
        return (token, cache), token

    _, rest = jax.lax.scan(body, (first, cache), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(model: LanguageModel, prompt: Int[Array, "b t"], max_new_tokens: int, *, rng=None,
             temperature: float = 0.0, top_k: int | None = None) -> Int[Array, "b n"]:
    """The ``max_new_tokens`` tokens that follow ``prompt`` [B, T] (T >= 1), [B, max_new_tokens].

    Greedy with temperature 0 (the default), else sampling with ``rng`` (a PRNG key; required).
    Compiled once per (model structure, prompt shape, max_new_tokens, greedy or not, top_k)."""
    if not hasattr(prompt, "ndim") or prompt.ndim != 2 or prompt.shape[1] < 1:
        shape = getattr(prompt, "shape", prompt)
        raise ValueError(f"prompt must be an int array [B, T] with T >= 1, got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.config.vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size], got {top_k!r}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng, a PRNG key")
    rng = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, jnp.asarray(prompt, jnp.int32), rng,
                     jnp.float32(temperature), max_new_tokens=max_new_tokens,
                     greedy=temperature == 0, top_k=top_k)
