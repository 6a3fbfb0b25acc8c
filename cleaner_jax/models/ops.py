"""The array operations of the Qwen forward that a caller may run with other kernels.

`Qwen.__call__(..., ops=...)` computes every projection, the LM head and attention through an
`Ops` object. The default, `XLA`, is plain einsums on any hardware (full-sequence attention
through the kernel `QwenConfig.attention_impl` names), and it is all the learner ever uses.
The rollout engine passes its decode backend instead (`rollout/decode_backend.py`), which may
route the shapes where XLA is slow to hand-written kernels (today only attention over the KV
cache on CPU, in decode steps and prefill chunks; every matmul stays XLA's). A substitute must compute the same
function; the model itself never looks at the hardware and imports no backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cleaner_jax.models import layers


class Ops:
    """Plain XLA: the reference every substitute is tested against."""

    name = "xla"

    def dense(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [N, D] @ w [D, F] -> [N, F] (a linear layer's kernel as stored)."""
        return jnp.einsum("nd,df->nf", x, w)

    def dense_t(self, x: jax.Array, w_t: jax.Array) -> jax.Array:
        """x [N, D] @ w_t [F, D]^T -> [N, F] (a tied embedding [V, H] used as the LM head, as stored)."""
        return jnp.einsum("nd,fd->nf", x, w_t)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, impl: str) -> jax.Array:
        """q [B, T, N, hd]; k, v [B, KV, S, hd]; mask [B, T, S] bool -> [B, T, N, hd] (`layers.attention`)."""
        return layers.attention(q, k, v, mask, impl)

    def causal_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array | None, impl: str) -> jax.Array:
        """q [B, T, N, hd]; k, v [B, T, KV, hd]; lengths [B] or None -> [B, T, N, hd]: the
        full-sequence path of attention_impl cudnn / xla_causal / splash (`layers.causal_attention`)."""
        return layers.causal_attention(q, k, v, lengths, impl)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


XLA = Ops()
