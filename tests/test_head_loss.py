"""train/head_loss.py: the LM head and token loss as one op, against optax on the logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import rel_err
from train.data import IGNORE_INDEX
from train.head_loss import head_loss_sums


def plain_sums(h, w, targets):
    """The sums by optax on float32 logits, differentiated by autodiff."""
    logits = jnp.matmul(h, w, preferred_element_type=jnp.float32)
    mask = targets != IGNORE_INDEX
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, targets, 0))
    correct = (jnp.argmax(logits, axis=-1) == targets) & mask
    return (jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(correct, dtype=jnp.int32),
            jnp.sum(mask, dtype=jnp.int32))


def inputs(dtype):
    kh, kw, kt = jax.random.split(jax.random.PRNGKey(7), 3)
    h = jax.random.normal(kh, (3, 11, 16)).astype(dtype)
    w = (0.5 * jax.random.normal(kw, (16, 37))).astype(dtype)
    targets = jax.random.randint(kt, (3, 11), 0, 37).at[0, :4].set(IGNORE_INDEX)
    return h, w, targets


def test_sums_and_gradients_match_optax_on_the_logits():
    """float32: the sums as optax's and the gradients of nll / count as autodiff's (to float32
    rounding); bf16: the same sums (the logits alike) and gradients within bf16's rounding of
    ∂logits; ignored tokens add nothing."""
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        h, w, targets = inputs(dtype)
        got, want = head_loss_sums(h, w, targets), plain_sums(h, w, targets)
        assert rel_err(got[0], want[0]) < 1e-6 and got[1:] == want[1:] and int(got[2]) == 29
        loss = lambda f: lambda h, w: f(h, w, targets)[0] / 29.0  # noqa: E731
        g_got = jax.grad(loss(head_loss_sums), argnums=(0, 1))(h, w)
        g_want = jax.grad(loss(plain_sums), argnums=(0, 1))(
            h.astype(jnp.float32), w.astype(jnp.float32))
        for a, b in zip(g_got, g_want):
            assert a.dtype == dtype and rel_err(a, b) < tol, (dtype, rel_err(a, b))
        np.testing.assert_array_equal(g_got[0][0, :4], 0)  # ignored tokens: no gradient


def test_backward_is_two_matmuls_on_the_saved_gradient():
    """The backward reads no logits: the residuals are h, W and ∂logits in the compute dtype
    (bf16 [..., V], half the float32 logits), and its only dots take bf16 operands."""
    h, w, targets = inputs(jnp.bfloat16)
    _, vjp = jax.vjp(lambda h, w: head_loss_sums(h, w, targets)[0], h, w)
    saved = [x for x in jax.tree.leaves(vjp) if hasattr(x, "shape") and x.shape[-1:] == (37,)]
    assert saved and all(x.dtype == jnp.bfloat16 for x in saved)
    hlo = jax.jit(lambda h, w: jax.grad(lambda h, w: head_loss_sums(h, w, targets)[0],
                                        argnums=(0, 1))(h, w)).lower(h, w).as_text()
    dots = [line.split("->")[0] for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all("f32>" not in d for d in dots), dots
