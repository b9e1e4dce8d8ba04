# Copyright © 2026 turboquant_mlx contributors.

"""The fp16 window of :class:`~turboquant_mlx.cache.TurboQuantKVCache` and the decode
steps' copies of it: which tokens stay unquantized, when they leave for the
compressed segment, and the buffers that make a decode step's window update cheap.

* The window (``_win_k``/``_win_v``): views of the positions
  ``[_win_start, offset)``, model space, in a buffer with ``window_slack`` free slots
  after them (``_win_buf``) that single tokens are written into in place; single
  tokens of deferred writes wait in ``_win_pending`` until the window is read.
* The code tail (``_code_tail``): the last decode step's sinks and window in code
  space, so that a token leaving the window is quantized without being transformed
  again.
* The ring (``_ring``): the sinks and window as the attention op's tail, in ring
  order (window position ``p`` at slot ``ns + (p - fp16_sink_tokens) % R``); each
  single-token step overwrites the slot of the token that leaves the window, so the
  tail is never concatenated again.
"""

import collections
from typing import List, NamedTuple, Optional

import mlx.core as mx

from . import ops
from ._common import _cat, _is_empty


class Ring(NamedTuple):
    """The sinks and the full window as the attention op's tail, in ring order (see
    :func:`ring_slot`); in sync while the cache holds ``position`` tokens. Model space
    where the ops apply the rotation, else code space."""

    keys: mx.array  # (B, H_kv, ns + R, D)
    values: mx.array
    position: int


class WindowBuffer(NamedTuple):
    """The buffer the window is a view of, with free slots after it (see
    ``WindowMixin._window_append``)."""

    keys: mx.array  # (B, H_kv, slots, D)
    values: mx.array
    lo: int  # first used slot
    view: mx.array  # the view of ``keys`` that was the window: the buffer serves while it is


class CodeTail(NamedTuple):
    """A decode step's sinks and window in code space, as it gave them to the op."""

    keys: mx.array  # (B, H_kv, sinks + window tokens, D)
    values: mx.array
    sinks: int  # sink tokens, first
    window_start: int  # position of the window's first token
    roll: int  # the window in ring order (:func:`ring_roll`), or 0: in position order


def ring_slot(ns: int, position: int, sinks: int, R: int) -> int:
    """Slot of window position ``position`` in a ring of ``ns`` sink slots and an
    ``R``-token window (``sinks``: the cache's ``fp16_sink_tokens``). A token that
    enters the window takes the slot of the one that leaves it (``position - R``)."""
    return ns + (position - sinks) % R


def ring_roll(window_start: int, sinks: int, R: int, n_win: int) -> int:
    """How far :func:`ring_order` rotates a window of ``n_win`` tokens from position
    ``window_start``: only a full window (``n_win == R``) goes in in ring order."""
    return (window_start - sinks) % R if R and n_win == R else 0


def ring_order(parts: List[mx.array], R: int, roll: int) -> List[mx.array]:
    """``parts`` (sinks first, the window last, in position order along axis 2) with
    the window rotated by ``roll`` (:func:`ring_roll`), so that a full window's
    position ``p`` is at :func:`ring_slot` of ``p``. Whatever step builds a tail from
    the window, the tail is then the same array as the ring, summed in the same order."""
    if not roll:
        return parts
    return parts[:-1] + [parts[-1][:, :, R - roll :], parts[-1][:, :, : R - roll]]


class WindowMixin:
    """The fp16 window, the code tail and the ring (module docstring), and storing
    non-sink tokens through them. A part of :class:`TurboQuantKVCache`, on its
    attributes."""

    def _drop_code_space(self):
        """Forgets the decode steps' copies of the sinks and window (after anything that
        changes which tokens the window holds or how they are transformed)."""
        # The tail of the last decode step that built one (a CodeTail), in code space
        # (centered, scaled, rotated). A window token
        # leaving for the compressed segment is quantized from it instead of being
        # transformed again. (Ops on code-space queries only, see _op_signs.)
        self._code_tail = None
        # Single-token decode steps keep the tail as a Ring: sinks in the first ns
        # slots, window position p in slot ring_slot(ns, p, ...), in sync while the
        # cache holds `position` tokens. Each step overwrites the slot of the token that leaves
        # the window with the new one, so the tail is never concatenated again. In the
        # ops' tail space: the model's with _op_signs, else code space.
        self._ring = None
        # What read the model-space ring since its last write (the attention op's
        # output, the window rebuilt from it): the next in-place write into the ring
        # follows them (ops.write_tokens_kv's `after`).
        self._ring_readers = []
        # (position, key, value) of the last single tokens, for their quantization when
        # they leave the window: as they arrived (model space) with _op_signs, else the
        # code-space copies the ring steps made.
        self._ring_tokens = collections.deque(maxlen=self.fp16_recent_tokens + 1)

    @property
    def _window_capacity(self) -> int:
        if self.fp16_recent_tokens == 0:
            return 0
        return self.fp16_recent_tokens + self.rollback_tokens

    def _store(self, rk: mx.array, rv: mx.array, P: int):
        """Stores non-sink tokens at positions ``[P, P + n)`` (``P`` = tokens held so far)."""
        n = rk.shape[2]
        S = self.fp16_sink_tokens
        if not self._calibrated:
            # Everything non-sink stays unquantized in the window buffer, from S.
            self._win_k = _cat(self._win_k, rk)
            self._win_v = _cat(self._win_v, rv)
            self._win_start = S
            return
        R = self.fp16_recent_tokens
        if R == 0:
            self._quantize(rk, rv)
            self._win_start = P + n
            return
        first = S + self._n_comp  # first position not yet quantized
        end = P + n - R  # positions before this leave the window
        keep_from = max(self._win_start, P + n - self._window_capacity)
        if n == 1 and self._defer_window_write(rk, rv, P, first, end, keep_from):
            return
        # The window buffer covers positions [win_start, P); with the new tokens,
        # [win_start, P + n). Spans of it are taken as views where they lie in one
        # of the two, so that a decode step copies the window once.
        held = 0 if _is_empty(self._win_k) else self._win_k.shape[2]

        def span(a, b):
            i, j = a - self._win_start, b - self._win_start
            if j <= held:
                return self._win_k[:, :, i:j], self._win_v[:, :, i:j]
            if i >= held:
                return rk[:, :, i - held : j - held], rv[:, :, i - held : j - held]
            return (
                mx.concatenate([self._win_k[:, :, i:], rk[:, :, : j - held]], axis=2),
                mx.concatenate([self._win_v[:, :, i:], rv[:, :, : j - held]], axis=2),
            )

        if end > first:
            if self._op_signs() is not None:
                # A token that arrived alone is quantized from that array, so that the
                # append does not hold the window buffer that this step writes into.
                self._quantize(*(self._recent_token(first, end) or span(first, end)))
            else:
                in_code_space = self._code_tail_span(first, end)
                if in_code_space is not None:
                    self._append_code_space(*in_code_space)
                else:
                    self._quantize(*span(first, end))
        if n == 1 and self._op_signs() is not None:
            self._ring_tokens.append((P, rk, rv))
        drop = keep_from - self._win_start
        if n <= self.decode_max_queries and 0 < held and drop <= held:
            self._window_append(rk, rv, drop)
        else:
            wk, wv = span(keep_from, P + n)
            self._win_k, self._win_v = mx.contiguous(wk), mx.contiguous(wv)
            self._win_buf = None
        self._win_start = keep_from

    def _defer_window_write(
        self, rk: mx.array, rv: mx.array, P: int, first: int, end: int, keep_from: int
    ) -> bool:
        """A single token's window update (position ``P``; positions ``[first, end)``
        leave the window, ``keep_from`` is its new start) without touching the window
        buffer, when the ops take model-space tails (a ring step's tail is the ring, not
        the window): the token that leaves is quantized from the array it arrived in
        (or, if it came with a prefill, from the window buffer), and the new one waits
        in ``_win_pending`` until the window is read, the ring holds R of them, or
        ``window_slack`` wait. Returns False where that does not apply."""
        signs = self._op_signs()
        if signs is None or _is_empty(self._win_k_stored):
            return False
        if end > first and not self._ring_append(rk, rv, P, first, end, signs):
            leaving = self._recent_token(first, end) or self._stored_window_token(first, end)
            if leaving is None:
                return False
            self._quantize(*leaving)
        self._win_pending.append((rk, rv))
        self._win_pending_drop += keep_from - self._win_start
        self._win_start = keep_from
        self._ring_tokens.append((P, rk, rv))
        if len(self._win_pending) >= self.window_slack:
            self._sync_window()
        return True

    def _ring_append(self, rk: mx.array, rv: mx.array, P: int, first: int, end: int, signs) -> bool:
        """The single token at ``P`` enters a ring in sync with a full window, and the
        token at ``first`` (``P - R``), which leaves it from the same slot, is
        quantized, both as one node (:func:`ops.ring_append_kv`; ``signs``: the
        cache's :meth:`_op_signs`). The ring then holds position ``P``: the step's
        attention reads it as it is. False (nothing done) where that does not apply."""
        ring, R = self._ring, self.fp16_recent_tokens
        if (
            ring is None
            or ring.position != P
            or end - first != 1
            or first != P - R
            or not ops.has_ring_append()
        ):
            return False
        slot = ring_slot(ring.keys.shape[2] - R, P, self.fp16_sink_tokens, R)
        self._ring = None  # only the ring may hold its buffers (written in place)
        self._ensure_capacity(self._n_comp + 1)
        after, self._ring_readers = self._ring_readers, []
        ring_k, ring_v = self._kv.ring_write(
            ring.keys,
            ring.values,
            rk,
            rv,
            self._n_comp,
            slot,
            key_signs=signs,
            value_signs=signs if self.rotate_values else None,
            key_mean=self._mu_k,
            value_mean=self._mu_v,
            after=after,
        )
        self._n_comp += 1
        self._ring = Ring(ring_k, ring_v, P + 1)
        return True

    def _sync_window(self):
        """Writes the pending tokens (see :meth:`_defer_window_write`) into the window."""
        pending, drop = self._win_pending, self._win_pending_drop
        self._win_pending, self._win_pending_drop = [], 0
        R = self.fp16_recent_tokens
        ring = self._ring
        held = self._win_k_stored.shape[2]
        if (
            len(pending) == R
            and ring is not None
            and ring.position == self.offset
            and drop <= held
            and self._op_signs() is not None
        ):
            # The pending tokens are the window's last R positions, which the ring (in
            # sync) holds too: the window is rebuilt from the kept older part and the
            # ring's two runs, three copies instead of one per pending token.
            ns = ring.keys.shape[2] - R
            r0 = ring_slot(ns, self.offset - R, self.fp16_sink_tokens, R)  # the oldest token
            ring_k, ring_v = ring.keys, ring.values
            parts_k = [self._win_k_stored[:, :, drop:], ring_k[:, :, r0:], ring_k[:, :, ns:r0]]
            parts_v = [self._win_v_stored[:, :, drop:], ring_v[:, :, r0:], ring_v[:, :, ns:r0]]
            wk = mx.concatenate([a for a in parts_k if a.shape[2]], axis=2)
            wv = mx.concatenate([a for a in parts_v if a.shape[2]], axis=2)
            # They read the ring: the next in-place write follows them (which also
            # evaluates them with the next step, so that rebuilds do not chain).
            self._ring_readers += [wk, wv]
            self._win_k, self._win_v = wk, wv
            self._win_buf = None
            return
        if len(pending) == 1:
            rk, rv = pending[0]
        else:
            rk = mx.concatenate([k for k, _ in pending], axis=2)
            rv = mx.concatenate([v for _, v in pending], axis=2)
        if drop > held:  # the pending tokens' own first ones left the window already
            rk, rv = rk[:, :, drop - held :], rv[:, :, drop - held :]
            drop = held
        self._window_append(rk, rv, drop)

    # The fp16 window (model space): views of the positions [win_start, offset), with
    # the single tokens of deferred writes (see _defer_window_write) written on read.
    @property
    def _win_k(self) -> Optional[mx.array]:
        if self._win_pending:
            self._sync_window()
        return self._win_k_stored

    @_win_k.setter
    def _win_k(self, value):
        self._win_k_stored = value
        self._win_pending, self._win_pending_drop = [], 0

    @property
    def _win_v(self) -> Optional[mx.array]:
        if self._win_pending:
            self._sync_window()
        return self._win_v_stored

    @_win_v.setter
    def _win_v(self, value):
        self._win_v_stored = value
        self._win_pending, self._win_pending_drop = [], 0

    window_slack = 64  # free slots after the window in its buffer (see _window_append)

    def _window_append(self, rk: mx.array, rv: mx.array, drop: int):
        """Appends decode-sized ``rk``/``rv`` to the window and drops its first ``drop``
        tokens. The window is a view of a buffer with ``window_slack`` free slots
        after it: the new tokens are written into them in place (MLX reuses the buffer
        when nothing else holds it), and the buffer is rebuilt when they run out."""
        held = self._win_k.shape[2]
        n = rk.shape[2]
        buf = self._win_buf
        if buf is not None and buf.view is self._win_k and buf.lo + held + n <= buf.keys.shape[2]:
            bk, bv, lo = buf.keys, buf.values, buf.lo
            # Only the buffer may refer to it when the update runs, or MLX copies it.
            buf = self._win_buf = None
            self._win_k = self._win_v = None
            bk[:, :, lo + held : lo + held + n] = rk
            bv[:, :, lo + held : lo + held + n] = rv
            lo += drop
        else:
            B, H, _, D = rk.shape
            pad = mx.zeros((B, H, self.window_slack, D), dtype=rk.dtype)
            bk = mx.concatenate([self._win_k[:, :, drop:], rk, pad], axis=2)
            bv = mx.concatenate([self._win_v[:, :, drop:], rv, pad], axis=2)
            lo = 0
            # A decode step whose tail comes from the ring does not read the window,
            # so its in-place writes would pile up unevaluated (each holding its
            # token) until something reads it: evaluate them with each rebuild.
            mx.async_eval(bk, bv)
        size = held + n - drop
        self._win_k, self._win_v = bk[:, :, lo : lo + size], bv[:, :, lo : lo + size]
        self._win_buf = WindowBuffer(bk, bv, lo, self._win_k)

    def _recent_token(self, a: int, b: int):
        """Model-space ``(key, value)`` of position ``a`` when ``b == a + 1`` and it
        arrived alone (op-rotation caches keep the last such tokens), else None."""
        if b - a == 1 and self._ring_tokens:
            # (the tokens are usually consecutive positions: look there first)
            i = a - self._ring_tokens[0][0]
            if 0 <= i < len(self._ring_tokens) and self._ring_tokens[i][0] == a:
                return self._ring_tokens[i][1:]
            for p, k, v in self._ring_tokens:
                if p == a:
                    return k, v
        return None

    def _stored_window_token(self, a: int, b: int):
        """``(key, value)`` of position ``a`` (``b == a + 1``) as views of the stored
        window buffer, where it lies there, else None: the tokens that came with a
        prefill leave the window from it (those that arrived alone, from
        :meth:`_recent_token`). Deferred writes leave that buffer as it is, and its
        first position is ``_win_start - _win_pending_drop`` while they wait."""
        win_k = self._win_k_stored
        if b - a != 1 or _is_empty(win_k):
            return None
        i = a - (self._win_start - self._win_pending_drop)
        if not 0 <= i < win_k.shape[2]:
            return None
        return win_k[:, :, i : i + 1], self._win_v_stored[:, :, i : i + 1]

    def _code_tail_span(self, a: int, b: int):
        """Window positions ``[a, b)`` in code space from the last decode step's tail,
        or None where it does not hold them."""
        if b - a == 1:
            for p, k, v in self._ring_tokens:
                if p == a:
                    return k, v
        if self._code_tail is None:
            return None
        tk, tv, ns, wpos, roll = self._code_tail
        n_win = tk.shape[2] - ns
        if not (wpos <= a and b <= wpos + n_win):
            return None
        i = ns + (a - wpos + roll) % n_win
        if i + b - a > tk.shape[2]:
            return None  # the span wraps around the ring's end
        return tk[:, :, i : i + b - a], tv[:, :, i : i + b - a]

    def _layout(self):
        """``(ns, c, wpos)``: sink count, compressed tokens in use, window start."""
        S = self.fp16_sink_tokens
        ns = 0 if self._sink_k is None else self._sink_k.shape[2]
        if not self._calibrated:
            return ns, 0, S
        if self.fp16_recent_tokens == 0:
            c = max(0, self.offset - S)
        else:
            c = max(0, max(self.offset - self.fp16_recent_tokens, self._win_start) - S)
        return ns, c, S + c
