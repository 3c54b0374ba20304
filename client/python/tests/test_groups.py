"""Several model groups in one refitd (a target and a draft of other shapes):
status of every group, per-group readiness, linked commits from Python and
from refitctl, and a failure in one group leaving every group unchanged."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
import torch

from conftest import READY_LINE, load_state_dict, refitctl, stepping
from refit_client import InvalidArgument, NotFound, RefitClient

GROUPS = ("--group=target=demo", "--group=draft=demo,tp=2,quant=block,seed=5")


@pytest.fixture
def two_groups(start_daemon):
    daemon = start_daemon(*GROUPS)
    # start_daemon waits for the first group's ready line; the draft loads after it.
    daemon.wait_for_line(READY_LINE, also="group=draft")
    return daemon


@pytest.fixture
def gclient(two_groups):
    with RefitClient(two_groups.address, timeout=30) as c:
        yield c


def versions(client):
    return {s.model_group: s.version for s in client.statuses()}


def test_statuses_list_every_group_default_first(gclient):
    statuses = gclient.statuses()
    assert [s.model_group for s in statuses] == ["target", "draft"]
    assert [s.model.tp_size for s in statuses] == [1, 2]
    assert statuses[1].model.quantization == "block"
    assert gclient.status(group="draft").model.tp_size == 2
    assert gclient.health().ready == "SERVING"
    assert gclient.health(group="draft").ready == "SERVING"
    assert gclient.health(group="eagle").ready == "SERVICE_UNKNOWN"
    with pytest.raises(NotFound, match="eagle"):
        gclient.status(group="eagle")


def test_push_linked_commits_both_groups(gclient, weights):
    new = load_state_dict(weights(2))
    results = gclient.push_linked({"target": new, "draft": new}, label="step 1")
    assert {g: r.version for g, r in results.items()} == {"target": 2, "draft": 2}
    assert versions(gclient) == {"target": 2, "draft": 2}
    statuses = {s.model_group: s for s in gclient.statuses()}
    assert statuses["draft"].fingerprint == results["draft"].fingerprint
    assert statuses["target"].active_refit is None and statuses["draft"].active_refit is None


def test_a_bad_tensor_for_the_draft_aborts_the_target_too(gclient, weights):
    new = load_state_dict(weights(2))
    bad = dict(new)
    bad["model.norm.weight"] = torch.full_like(new["model.norm.weight"], float("nan"))
    with pytest.raises(InvalidArgument, match="model.norm.weight"):
        gclient.push_linked({"target": new, "draft": bad})
    assert versions(gclient) == {"target": 1, "draft": 1}
    # The target's prepared refit was aborted: its slot is free.
    assert all(s.active_refit is None for s in gclient.statuses())


def test_commit_with_linked_refits(gclient, weights):
    new = load_state_dict(weights(3))
    target = gclient.push(new, prepare=True, group="target")
    draft = gclient.push(new, prepare=True, group="draft")
    result = gclient.commit(target.refit_id, group="target", linked=[("draft", draft.refit_id)])
    assert result.version == 2 and result.refit_id == target.refit_id
    assert versions(gclient) == {"target": 2, "draft": 2}


def test_refitctl_status_push_link_and_commit_linked(two_groups, weights):
    addr = two_groups.address
    out = refitctl(addr, "status")
    assert out.returncode == 0, out.stderr
    assert "group        target" in out.stdout and "group        draft" in out.stdout
    status = json.loads(refitctl(addr, "status", "--json").stdout)
    assert status["model_group"] == "target"
    assert [g["model_group"] for g in status["groups"]] == ["target", "draft"]
    one = json.loads(refitctl(addr, "--group=draft", "status", "--json").stdout)
    assert one["model_group"] == "draft" and "groups" not in one

    health = refitctl(addr, "--group=draft", "health")
    assert health.returncode == 0, health.stderr

    push = refitctl(addr, "push", str(weights(2)), f"--link=draft={weights(2)}", "--json")
    assert push.returncode == 0, push.stderr
    pushed = json.loads(push.stdout)
    assert pushed["version"] == 2 and pushed["linked"][0]["version"] == 2

    prepared = refitctl(addr, "push", str(weights(4)), f"--link=draft={weights(4)}", "--prepare")
    assert prepared.returncode == 0, prepared.stderr
    assert "--linked draft=" in prepared.stdout
    statuses = json.loads(refitctl(addr, "status", "--json").stdout)["groups"]
    target_id = statuses[0]["active_refit"]["refit_id"]
    draft_id = statuses[1]["active_refit"]["refit_id"]
    commit = refitctl(addr, "commit", target_id, f"--linked=draft={draft_id}")
    assert commit.returncode == 0, commit.stderr
    assert "linked commit of 2 groups" in commit.stdout
    after = json.loads(refitctl(addr, "status", "--json").stdout)["groups"]
    assert [g["version"] for g in after] == [3, 3]


def test_refitctl_push_link_with_a_bad_draft_aborts_the_target_too(two_groups, weights, tmp_path):
    from safetensors.torch import save_file

    addr = two_groups.address
    bad = load_state_dict(weights(2))
    bad["model.norm.weight"] = torch.full_like(bad["model.norm.weight"], float("inf"))
    bad_dir = tmp_path / "bad-draft"
    bad_dir.mkdir()
    save_file(bad, str(bad_dir / "model.safetensors"))
    push = refitctl(addr, "push", str(weights(2)), f"--link=draft={bad_dir}")
    assert push.returncode == 2, push.stderr
    assert "model group draft" in push.stderr and "INVALID_ARGUMENT" in push.stderr
    after = json.loads(refitctl(addr, "status", "--json").stdout)["groups"]
    assert [g["version"] for g in after] == [1, 1]
    assert all(g["active_refit"] is None for g in after)


@contextlib.contextmanager
def _two_attached(start_daemon, quiesce_timeout, names):
    """A daemon with groups a and b (same shapes, other weights), a client,
    and one engine attached with coordination to each group."""
    from refit_client import attach

    daemon = start_daemon("--group=a=demo", "--group=b=demo,seed=7",
                          f"--engine-quiesce-timeout={quiesce_timeout}")
    daemon.wait_for_line(READY_LINE, also="group=b")
    with RefitClient(daemon.address, timeout=30) as c, \
            attach(daemon.address, group="a", name=names[0]) as a, \
            attach(daemon.address, group="b", name=names[1]) as b:
        yield c, a, b


def test_a_linked_commit_held_up_by_one_groups_engine_names_that_group_to_every_engine(
        start_daemon, weights):
    # Engine ids are per group ("e-1" in both): the engines of the group that
    # did quiesce are told which group's engine held the commit up.
    from refit_client import RefitError

    new = load_state_dict(weights(2))
    with _two_attached(start_daemon, "500ms", ("ready", "stuck")) as (c, ready, stuck):
        assert ready.engine_id == stuck.engine_id  # ids are per group
        events = []

        def on_event(ev) -> None:
            events.append(ev)
            if ev.kind == "commit_pending":
                ready.safe_point()

        ready.on_event(on_event)
        with pytest.raises(RefitError) as e:
            c.push_linked({"a": new, "b": new})
        assert f'model group "b": engine "{stuck.engine_id}" ("stuck")' in str(e.value)
        assert "did not quiesce" in str(e.value)
        # The daemon's message says the refits stay PREPARED; push_linked
        # then aborted them, and says so.
        assert "[push_linked aborted the refits it prepared: a: r-" in e.value.message
        assert "push_linked aborted" in str(e.value)
        assert all(s.active_refit is None for s in c.statuses())
        assert versions(c) == {"a": 1, "b": 1}
        aborted = [ev for ev in events if ev.kind == "aborted"]
        assert aborted, events
        assert f'model group "b": engine "{stuck.engine_id}" ("stuck")' in aborted[0].reason


def test_an_abort_of_one_refit_ends_the_linked_commit_waiting_for_engines(start_daemon, weights):
    # Neither engine reaches a safe point: an operator's Abort of the draft's
    # refit ends the linked commit at once, and every refit of it.
    from refit_client import RefitConflict, RefitError

    new = load_state_dict(weights(2))
    with _two_attached(start_daemon, "60s", ("target", "draft")) as (c, a, b):
        ra = c.push(new, group="a", prepare=True)
        rb = c.push(new, group="b", prepare=True)
        events_a, events_b = a.events(timeout=30), b.events(timeout=30)
        outcome = {}

        def commit() -> None:
            try:
                outcome["result"] = c.commit(ra.refit_id, group="a", linked=[("b", rb.refit_id)])
            except RefitError as e:
                outcome["error"] = e

        committer = threading.Thread(target=commit)
        committer.start()
        assert next(events_a).kind == "commit_pending"
        assert next(events_b).kind == "commit_pending"
        with RefitClient(c.address, timeout=30) as operator:
            operator.abort(rb.refit_id, reason="draft engine stuck", group="b")
        committer.join(30)
        assert not committer.is_alive()
        assert isinstance(outcome.get("error"), RefitConflict), outcome
        assert "draft engine stuck" in str(outcome["error"])
        for events in (events_a, events_b):
            event = next(events)
            assert event.kind == "aborted" and "draft engine stuck" in event.reason, event
        assert versions(c) == {"a": 1, "b": 1}
        assert all(s.active_refit is None for s in c.statuses())
        for group, refit in (("a", ra), ("b", rb)):
            with pytest.raises(NotFound):
                c.abort(refit.refit_id, group=group)


def test_an_engine_that_attaches_to_a_group_already_quiesced_is_waited_for_too(
        start_daemon, weights):
    # Group a's engine acks at once; b's acks only once a third engine has
    # attached to a while the commit waited for b. That engine is asked and
    # never reaches its safe point: the linked commit must not copy under
    # it (it could be reading the weights), and fails naming it.
    import time

    from refit_client import RefitError, attach

    new = load_state_dict(weights(2))
    daemon = start_daemon("--group=a=demo", "--group=b=demo,seed=7",
                          "--engine-quiesce-timeout=3s")
    daemon.wait_for_line(READY_LINE, also="group=b")
    with RefitClient(daemon.address, timeout=30) as c, \
            attach(daemon.address, group="a", name="fast") as a, \
            attach(daemon.address, group="b", name="slow") as b:
        b_asked, late_attached = threading.Event(), threading.Event()
        b.on_event(lambda ev: b_asked.set() if ev.kind == "commit_pending" else None)

        def step_b() -> None:
            if late_attached.wait(0.01):
                b.safe_point(timeout=10)

        outcome = {}

        def push() -> None:
            try:
                outcome["result"] = c.push_linked({"a": new, "b": new})
            except RefitError as e:
                outcome["error"] = e

        with stepping(lambda: a.safe_point(timeout=10), pause=0.001), \
                stepping(step_b, pause=0.001):
            pusher = threading.Thread(target=push)
            pusher.start()
            assert b_asked.wait(30)
            time.sleep(0.3)  # a has acked (it steps every millisecond): b alone is waited for
            with attach(daemon.address, group="a", name="late") as late:
                assert late.version == 1
                late_attached.set()
                pusher.join(30)
        assert "result" not in outcome, "the linked commit copied under an engine not quiesced"
        message = str(outcome["error"])
        assert 'model group "a"' in message and '("late")' in message, message
        assert "did not quiesce" in message
        assert versions(c) == {"a": 1, "b": 1}
        # Once every engine is at a safe point, the refits (still PREPARED)
        # are not needed: a fresh linked push goes through.
        with stepping(lambda: a.safe_point(timeout=10), pause=0.001), \
                stepping(lambda: b.safe_point(timeout=10), pause=0.001):
            results = c.push_linked({"a": new, "b": new})
        assert {g: r.version for g, r in results.items()} == {"a": 2, "b": 2}


def test_one_engine_on_two_groups_follows_a_linked_commit_with_safe_point_all(
        start_daemon, weights):
    # A target and its draft served by one engine thread: safe_point_all acks
    # both groups' CommitPending and holds
    # until the one copy has ended.
    from refit_client import safe_point_all

    new = load_state_dict(weights(2))
    with _two_attached(start_daemon, "2s", ("target", "draft")) as (c, a, b):
        def ptrs():
            return [{n: t.data_ptr() for n, t in e.tensors.items()} for e in (a, b)]

        before = ptrs()
        seen = []  # the versions the engine's next step serves, after each pause

        def step() -> None:
            if safe_point_all([a, b], timeout=10):
                seen.append((a.version, b.version))

        with stepping(step, pause=0.001):
            results = c.push_linked({"a": new, "b": new})
        assert {g: r.version for g, r in results.items()} == {"a": 2, "b": 2}
        assert versions(c) == {"a": 2, "b": 2}
        # The engine paused for the commit in both attachments, once.
        assert [v for v, _ in a.pauses] == [2] and [v for v, _ in b.pauses] == [2]
        assert a.pauses[0][1] < 2.0
        # Its Committed was delivered before safe_point_all returned.
        assert seen == [(2, 2)]
        assert ptrs() == before
        assert a.consistent(lambda: a.version) == 2 and b.consistent(lambda: b.version) == 2


def test_one_engine_on_two_groups_calling_each_safe_point_holds_a_linked_commit_up(
        start_daemon, weights):
    # What safe_point_all is for: the first safe point acks and holds for a
    # copy that waits for the second group's ack, which that thread cannot
    # send; the commit fails at --engine-quiesce-timeout, changing nothing.
    from refit_client import RefitError

    new = load_state_dict(weights(2))
    with _two_attached(start_daemon, "500ms", ("target", "draft")) as (c, a, b):
        with stepping(lambda: (a.safe_point(timeout=10), b.safe_point(timeout=10)), pause=0.001):
            with pytest.raises(RefitError, match="did not quiesce"):
                c.push_linked({"a": new, "b": new})
        assert versions(c) == {"a": 1, "b": 1}


def test_a_linked_commit_asks_the_engines_of_every_group_at_once(start_daemon, weights):
    # Both groups' engines are asked before either's ack is awaited: an engine
    # of group a that reaches its safe point only once group b's engine has
    # been asked (engines stepping in lockstep) lets the commit through; were
    # the groups asked one after the other, a's ack would wait for b's ask and
    # b's ask for a's ack until --engine-quiesce-timeout.
    import threading

    new = load_state_dict(weights(2))
    with _two_attached(start_daemon, "3s", ("target", "draft")) as (c, a, b):
        b_asked = threading.Event()
        b.on_event(lambda ev: b_asked.set() if ev.kind == "commit_pending" else None)

        def step_a() -> None:
            if b_asked.wait(0.01):
                a.safe_point(timeout=10)

        with stepping(step_a, pause=0.001), \
                stepping(lambda: b.safe_point(timeout=10), pause=0.001):
            results = c.push_linked({"a": new, "b": new})
        assert {g: r.version for g, r in results.items()} == {"a": 2, "b": 2}
        assert versions(c) == {"a": 2, "b": 2}
        assert [v for v, _ in a.pauses] == [2] and [v for v, _ in b.pauses] == [2]
        assert a.pauses[0][1] < 2.0 and b.pauses[0][1] < 2.0
