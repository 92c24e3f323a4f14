"""The pipeline executor's p2p (:class:`annot.runtime.pipeline.executor.PipelineExecutor`
inherits it): every message carries its key ``(direction, stage,
microbatch)``, a message that arrives before its RECV is kept for it, the
receive of a RECV's message is received at the RECV (or, with the executor's
``post_receives``, posted one action early under gloo so that the peer's
send writes at once; :func:`posts_early`), sends are async and waited
at the end of the step, and the last stage's step outputs go to every rank of
the pipeline. The executor sets the attributes used here (declared on
:class:`PipelineMessages`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from annot.core.errors import PipelineError
from annot.runtime.pipeline.model_call import StepState
from annot.runtime.pipeline.p2p import post_recv, recv_pytree, send_pytree
from annot.runtime.pipeline.p2p_codec import flatten, simple_signature
from annot.runtime.pipeline.schedules import RECV_B, RECV_F, Action, B, F, stage_rank
from annot.runtime.pipeline.trace import Tracer
from annot.runtime.trees import map_tensors

__all__ = ["PipelineMessages", "check_shareable", "posts_early"]

_DIRECTIONS = (F, B)  # a message tag's first int
# The step outputs' lane (annot.runtime.pipeline.p2p): once a step, they would otherwise
# make the next step's first message on the pair a two-part transfer.
_OUTPUTS_LANE = 1


def posts_early(group: Any) -> bool:
    """Whether RECVs are posted one action early on ``group``: under gloo only.
    gloo queues each send until its receive is posted, so posting early only
    lets the send leave sooner. NCCL runs a pair's sends and receives in order
    on one stream, where a receive posted before this rank's own send to the
    peer would wait for a message that send unblocks: a deadlock."""
    return "gloo" in str(dist.get_backend(group)).lower()


class PipelineMessages:
    """The p2p half of :class:`~annot.runtime.pipeline.executor.PipelineExecutor` (see
    the module docstring)."""

    # set by the executor
    peers: list[int]  # global rank of each pipeline rank
    group: Optional[dist.ProcessGroup]  # the pp group (None: the default group, or pp == 1)
    device: Optional[torch.device]  # where received tensors land (None: the comm device)
    timeout_s: Optional[float]
    rank: int  # global
    pp: int
    pp_rank: int
    num_stages: int
    v: bool  # stages placed in a V
    tracer: Tracer
    routes: dict[Action, tuple[int, Any, dict[str, Any]]]  # _route's, per action

    def owner(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return stage_rank(stage, self.pp, self.v)

    def share_outputs(self, outputs: Optional[list[Any]]) -> list[Any]:
        """The step body's results on the last stage (``outputs`` there,
        checked by :func:`check_shareable` as they were made), tensors
        detached, on every rank of the pipeline: the last rank sends them to
        the others, which receive them on a lane of their own (posting that
        receive at the step's start measured no faster on 2 cores, and a
        receive left posted by a failed step would take the next step's
        outputs)."""
        last = self.num_stages - 1
        if self.owner(last) != self.pp_rank:  # pp > 1
            return recv_pytree(
                self.peers[self.owner(last)],
                device=self.device,
                lane=_OUTPUTS_LANE,
                **self._outputs_labels(),
            )
        assert outputs is not None, "the last stage's rank has the step's outputs"
        outputs = map_tensors(torch.Tensor.detach, outputs)
        if self.pp == 1:
            return outputs
        handles = [
            send_pytree(outputs, dst, lane=_OUTPUTS_LANE, **self._outputs_labels())
            for dst in self.peers
            if dst != self.rank
        ]
        for h in handles:
            h.wait()
        return outputs

    def _outputs_labels(self) -> dict[str, Any]:
        last = self.num_stages - 1
        mine = self.owner(last) == self.pp_rank
        return dict(
            group=self.group,
            what="step outputs",
            timeout_s=self.timeout_s,
            stage=last if mine else self.pp_rank,
            **({} if mine else {"peer_stage": last}),
        )

    def send(self, st: StepState, a: Action, payload: Any) -> None:
        dst, _, kwargs = self._route(a)
        st.handles.append(send_pytree(payload, dst, **kwargs))

    def recv(self, st: StepState, a: Action) -> Any:
        """The payload of message ``a.message`` from its sender; messages from
        the same peer that arrive first are kept for their own RECV."""
        src, key, kwargs = self._route(a)
        box = st.inbox.setdefault(src, {})
        while key not in box:
            posted = st.posted.pop(src, None)
            tag, payload = recv_pytree(src, tagged=True, posted=posted, **kwargs)
            st.due[src] -= 1
            if tag is None or not 0 <= tag[0] < len(_DIRECTIONS):
                raise PipelineError(
                    f"rank {self.rank} expected a pipeline message for {a} from rank {src} but "
                    f"got one without a pipeline tag ({tag}); another p2p exchange is "
                    "interleaved with the pipeline on this pair of ranks"
                )
            got = (_DIRECTIONS[tag[0]], tag[1], tag[2])
            if got in box:
                raise PipelineError(f"rank {self.rank} received {got} from rank {src} twice")
            box[got] = payload
        return box.pop(key)

    def count_receives(self, st: StepState, actions: list) -> None:
        """How many messages each peer sends this rank in the step (so that
        :meth:`post_ahead` never posts a receive no message will match);
        :meth:`recv` counts them down, posted ahead or not."""
        for a in actions:
            if a.kind in (RECV_F, RECV_B):
                peer = self._source(a)
                st.due[peer] = st.due.get(peer, 0) + 1

    def post_ahead(self, st: StepState, a: Action) -> None:
        """Post the receive of RECV ``a``'s peer's next message now, one action
        early (:func:`annot.runtime.pipeline.p2p.post_recv`): the peer's send then
        writes at once instead of waiting for a reply from this rank."""
        peer = self._source(a)
        if peer not in st.posted and st.due.get(peer, 0) > 0:
            st.posted[peer] = post_recv(peer, **self._labels(a))

    def _route(self, a: Action) -> tuple[int, Any, dict[str, Any]]:
        """SEND or RECV ``a``'s peer (global rank), its message's key and the
        keyword arguments of its send_pytree / recv_pytree (group, timeout,
        fault-message labels, the tag or the device): worked out once per
        action, not on every step."""
        route = self.routes.get(a)
        if route is None:
            assert a.message is not None, f"{a} is not a SEND or a RECV"
            if a.kind in (RECV_F, RECV_B):
                peer = self._source(a)
                kwargs = self._labels(a)
                kwargs["device"] = self.device
            else:
                direction, dst_stage, i = a.message
                kwargs = dict(
                    group=self.group,
                    what="activations" if direction == F else "gradients",
                    timeout_s=self.timeout_s,
                    stage=a.stage,
                    microbatch=i,
                    peer_stage=dst_stage,
                    tag=(_DIRECTIONS.index(direction), dst_stage, i),
                )
                peer = self.peers[self.owner(dst_stage)]
            route = self.routes[a] = (peer, a.message, kwargs)
        return route

    def _labels(self, a: Action) -> dict[str, Any]:
        """The group, timeout and fault-message labels of RECV ``a``'s message."""
        return dict(
            group=self.group,
            what="activations" if a.kind == RECV_F else "gradients",
            timeout_s=self.timeout_s,
            stage=a.stage,
            microbatch=a.microbatch,
            peer_stage=_peer_stage(a),
        )

    def _source(self, a: Action) -> int:
        """The peer of RECV ``a`` (global rank)."""
        return self.peers[self.owner(_peer_stage(a))]

    def wait_sends(self, st: StepState) -> None:
        if not st.handles:
            return
        with self.tracer.span("wait sends", "p2p", {"count": len(st.handles)}, tid=self.pp_rank):
            for handle in st.handles:
                handle.wait()
        st.handles.clear()


def check_shareable(result: Any, microbatch: int) -> None:
    """Refuse the step body's ``result`` for ``microbatch`` on the last stage
    where it is made if it cannot cross to every rank
    (:meth:`PipelineMessages.share_outputs`), naming the microbatch,
    instead of failing the step's last message."""
    if simple_signature(result) is not None:
        return
    try:
        flatten(result, root="result")
    except PipelineError as err:
        raise PipelineError(
            f"the step body's return value of microbatch {microbatch}: {err} It goes to"
            " every pipeline rank (the step returns it on each): return tensors and plain"
            " values, e.g. `return loss`."
        ) from None


def _peer_stage(a: Action) -> int:
    """The stage whose message RECV ``a`` receives."""
    return a.stage - 1 if a.kind == RECV_F else a.stage + 1
