"""FleetClient: a fleet refit from Python, all members or none (docs/fleet.md).

The coordinator side of refitd's fleets, as `refitctl fleet push` does it:
the fleet lock (compare-and-swap on a lease), a prepare on every member in
parallel (the whole checkpoint, with RefitOptions.fleet_refit_id), the
decision written once in etcd with a compare-and-swap, then Commit on every
member. etcd is reached through its v3 JSON gateway (/v3/kv/range etc.,
base64 keys) over urllib, so nothing beyond grpcio is needed. ``tls`` (a
``Tls``) is TLS to the members, ``etcd_tls`` TLS to etcd (an https://
endpoint; its CA, and a client certificate for an etcd that requires one).
After a commit, decisions beyond the newest ``keep_decisions`` that are older
than every member's prepared timeout are deleted, as refitctl does.

    from refit_client import FleetClient
    result = FleetClient(etcd="127.0.0.1:2379", fleet="llama").push("/ckpt/step-100")
    print(result.fleet_version, result.flip_skew_seconds, result.members)
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import os
import re
import secrets
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import grpc

from ._client import Tls, _read_file
from ._proto import refit_pb2 as pb
from ._proto import refit_pb2_grpc as pb_grpc
from .errors import InvalidArgument, RefitConflict, RefitError, Unavailable, from_rpc_error

_DTYPES = {"BF16": pb.DTYPE_BF16, "F16": pb.DTYPE_F16, "F32": pb.DTYPE_F32}
_CHUNK = 32 << 20
# Fleet names, as refitd --fleet accepts them.
_FLEET_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclasses.dataclass
class FleetMemberResult:
    member_id: str
    address: str
    refit_id: str = ""
    committed: bool = False
    version: int = 0
    fingerprint: str = ""
    commit_unix_seconds: float = 0.0  # when its commit ended
    commit_seconds: float = 0.0  # its commit pause (the copy into the live kernels)
    error: str = ""


@dataclasses.dataclass
class FleetRefitResult:
    fleet_refit_id: str
    fleet_version: int
    members: List[FleetMemberResult]
    flip_skew_seconds: float


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    b[-1] += 1
    return bytes(b).decode()


class _Etcd:
    """etcd's v3 JSON gateway at one or more endpoints ("host:port",
    http:// or https://, comma-separated). A call goes to the endpoint that
    answered last; one that cannot be reached (refused, reset, timed out) is
    replaced by the next and the call is tried once on each, as refitd's
    EtcdClient does. Unavailable names every endpoint tried and why."""

    def __init__(self, endpoints: str, timeout: float = 5.0, tls: Optional[Tls] = None) -> None:
        self.bases: List[str] = []
        for endpoint in (e.strip() for e in endpoints.split(",")):
            if not endpoint:
                continue
            if not endpoint.startswith(("http://", "https://")):
                endpoint = ("https://" if tls is not None else "http://") + endpoint
            self.bases.append(endpoint.rstrip("/"))
        if not self.bases:
            raise RefitError(f"no etcd endpoint in {endpoints!r}")
        self.timeout = timeout
        self._current = 0
        self._lock = threading.Lock()
        self.context: Optional[ssl.SSLContext] = None
        if any(b.startswith("https://") for b in self.bases):
            tls = tls or Tls()
            self.context = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file or tls.key_file:
                if not (tls.cert_file and tls.key_file):
                    raise RefitError("an etcd client certificate needs both cert_file and key_file")
                self.context.load_cert_chain(tls.cert_file, tls.key_file)

    @property
    def base(self) -> str:
        """The endpoint calls go to first (the one that answered last)."""
        with self._lock:
            return self.bases[self._current]

    def call(self, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        data = json.dumps(body).encode()
        with self._lock:
            start = self._current
        failures = []
        for i in range(len(self.bases)):
            index = (start + i) % len(self.bases)
            base = self.bases[index]
            request = urllib.request.Request(base + path, data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout,
                                            context=self.context) as r:
                    answer = json.loads(r.read() or b"{}")
            except urllib.error.HTTPError as e:
                if e.code != 503:  # etcd answered: its refusal, not an unreachable endpoint
                    raise Unavailable(f"etcd {base}{path}: {e}") from None
                failures.append(f"etcd {base}{path}: {e}")  # a member without a leader
                continue
            except OSError as e:
                failures.append(f"etcd {base}{path}: {e}")
                continue
            with self._lock:
                self._current = index
            return answer
        raise Unavailable("; ".join(failures))

    def get_prefix(self, prefix: str) -> List[Dict[str, Any]]:
        r = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        return r.get("kvs", [])

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return kvs[0] if kvs else None

    def put(self, key: str, value: str, lease: str = "0") -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    def delete(self, key: str) -> int:
        return int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))


def _safetensors_chunks(files: Sequence[str]) -> Iterator[pb.Chunk]:
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            base = 8 + length
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                begin, end = t["data_offsets"]
                dtype = _DTYPES.get(t["dtype"])
                if dtype is None:
                    raise RefitError(f"{path}: tensor {name}: dtype {t['dtype']} is not pushed")
                for off in range(0, max(end - begin, 1), _CHUNK):
                    f.seek(base + begin + off)
                    data = f.read(min(_CHUNK, end - begin - off))
                    yield pb.Chunk(tensor_name=name, dtype=dtype, shape=t["shape"],
                                   byte_offset=off, data=data)


def _expand(paths: Union[str, Sequence[str]]) -> List[str]:
    # Every member reads the files itself: tensors cannot be handed over
    # here, and a path that is not a file is refused before the fleet lock.
    if isinstance(paths, Mapping):
        raise TypeError("FleetClient.push takes checkpoint paths (a directory or .safetensors "
                        "files), not tensors: save the state dict with safetensors first")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: List[str] = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"FleetClient.push takes checkpoint paths; got a {type(p).__name__}")
        p = os.fspath(p)
        if os.path.isdir(p):
            files += sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".safetensors"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise RefitError(f"no such checkpoint file or directory: {p}")
    if not files:
        raise RefitError(f"no .safetensors files in {paths}")
    return files


class FleetClient:
    """A coordinator of fleet refits through etcd (one refit at a time per
    fleet, whoever runs it). ``etcd``: the endpoints "host:port",
    comma-separated (https://host:port or ``etcd_tls`` for TLS; one that
    cannot be reached is skipped for the next); ``token``: the members' bearer token (refitd
    --auth-tokens); ``lock_ttl``: seconds of the fleet lock's lease; ``tls``:
    TLS to the members (refitd --tls-cert); ``etcd_tls``: TLS to etcd (its CA,
    a client certificate); ``keep_decisions``: decisions kept after a commit
    (0 keeps all)."""

    def __init__(self, etcd: str, fleet: str, *, token: Optional[str] = None,
                 lock_ttl: int = 10, timeout: Optional[float] = None,
                 tls: Optional[Tls] = None, etcd_tls: Optional[Tls] = None,
                 keep_decisions: int = 16) -> None:
        # The rule the daemons' --fleet follows: another name has no members.
        if not _FLEET_NAME.fullmatch(fleet) or fleet in (".", ".."):
            raise InvalidArgument(
                f"fleet {fleet!r}: a fleet name is 1 to 128 of [A-Za-z0-9._-]")
        self._etcd = _Etcd(etcd, tls=etcd_tls)
        self._tls = tls
        self._keep_decisions = keep_decisions
        self.fleet = fleet
        self._prefix = f"/refitd/fleet/{fleet}/"
        self._metadata = [("authorization", f"Bearer {token}")] if token else []
        self._lock_ttl = lock_ttl
        self._timeout = timeout

    def status(self) -> Dict[str, Any]:
        """The members' registrations and the fleet version, as refitctl fleet
        status --json shows them. Raises Unavailable when etcd is."""
        members = [json.loads(_unb64(kv["value"]))
                   for kv in self._etcd.get_prefix(self._prefix + "members/")]
        v = self._etcd.get(self._prefix + "version")
        version = json.loads(_unb64(v["value"])) if v else {}
        fleet_version = int(version.get("fleet_version", 0))
        return {"fleet": self.fleet, "fleet_version": fleet_version, "members": members,
                "last_flip_skew_seconds": version.get("flip_skew_seconds", 0.0),
                "consistent": bool(members) and all(
                    m.get("ready") and m.get("fleet_version") == fleet_version for m in members)}

    def _channel(self, address: str) -> grpc.Channel:
        options = [("grpc.max_send_message_length", 256 << 20)]
        if self._tls is None:
            return grpc.insecure_channel(address, options=options)
        t = self._tls
        if bool(t.cert_file) != bool(t.key_file):
            raise RefitError("a client certificate needs both cert_file and key_file")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read_file(t.ca_file, "TLS CA") if t.ca_file else None,
            private_key=_read_file(t.key_file, "TLS key") if t.key_file else None,
            certificate_chain=_read_file(t.cert_file, "TLS certificate") if t.cert_file else None)
        if t.server_name:
            options.append(("grpc.ssl_target_name_override", t.server_name))
        return grpc.secure_channel(address, credentials, options=options)

    def push(self, paths: Union[str, Sequence[str]], *, label: str = "") -> FleetRefitResult:
        """Every member gets the safetensors files of ``paths`` (a directory
        or files), prepared everywhere, then committed everywhere, or nowhere.
        Raises RefitConflict (another fleet refit holds the lock, a prepare
        failed, a member's deadline recorded abort first: nobody committed),
        Unavailable (etcd went away before the decision)."""
        files = _expand(paths)
        members = self.status()["members"]
        if not members:
            raise RefitError(f"fleet {self.fleet} has no members registered in etcd")
        frid = f"fleet-py-{int(time.time())}-{secrets.token_hex(5)}"
        lease = self._etcd.call("/v3/lease/grant", {"TTL": str(self._lock_ttl)})["ID"]
        holder = json.dumps({"fleet_refit_id": frid, "coordinator": f"{socket.gethostname()}:"
                             f"{os.getpid()} (python)"})
        lock = self._etcd.call("/v3/kv/txn", {
            "compare": [{"key": _b64(self._prefix + "lock"), "target": "CREATE",
                         "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(self._prefix + "lock"),
                                         "value": _b64(holder), "lease": lease}}]})
        if not lock.get("succeeded"):
            self._etcd.call("/v3/lease/revoke", {"ID": lease})
            raise RefitConflict(f"fleet {self.fleet}: a fleet refit is in progress; retry "
                                "once it has ended")
        done = threading.Event()

        def keepalive() -> None:
            while not done.wait(self._lock_ttl / 3):
                try:
                    self._etcd.call("/v3/lease/keepalive", {"ID": lease})
                except Unavailable:
                    pass

        keeper = threading.Thread(target=keepalive, daemon=True)
        keeper.start()
        try:
            return self._run(files, members, frid, label)
        finally:
            done.set()
            keeper.join()
            try:
                self._etcd.call("/v3/lease/revoke", {"ID": lease})
            except Unavailable:
                pass

    def _run(self, files: List[str], members: List[Dict[str, Any]], frid: str,
             label: str) -> FleetRefitResult:
        v = self._etcd.get(self._prefix + "version")
        version_mod = v["mod_revision"] if v else "0"
        fleet_version = (int(json.loads(_unb64(v["value"])).get("fleet_version", 0)) if v else 0) + 1
        results = [FleetMemberResult(m["member_id"], m["address"]) for m in members]
        # One channel per member for the whole refit: the commits go out on
        # the prepare's warm connections, at once.
        channels = [self._channel(r.address) for r in results]
        try:
            return self._run_on(files, results, channels, frid, label, version_mod,
                                fleet_version, members)
        finally:
            for channel in channels:
                channel.close()

    def _run_on(self, files: List[str], results: List[FleetMemberResult],
                channels: List[grpc.Channel], frid: str, label: str, version_mod: str,
                fleet_version: int, members: List[Dict[str, Any]]) -> FleetRefitResult:
        stubs = {id(r): pb_grpc.RefitServiceStub(c) for r, c in zip(results, channels)}

        def prepare(r: FleetMemberResult) -> None:
            options = pb.RefitOptions(completion=pb.COMPLETION_MODE_PREPARE,
                                      non_finite=pb.NON_FINITE_POLICY_REJECT,
                                      require_complete=True, label=label, fleet_refit_id=frid)

            def requests() -> Iterator[pb.PushRequest]:
                yield pb.PushRequest(begin=pb.Begin(options=options))
                for chunk in _safetensors_chunks(files):
                    yield pb.PushRequest(chunks=pb.Chunks(chunks=[chunk]))
                yield pb.PushRequest(end=pb.End())

            try:
                response = stubs[id(r)].Push(requests(), metadata=self._metadata,
                                             timeout=self._timeout)
                r.refit_id = response.result.refit_id
            except grpc.RpcError as e:
                r.error = str(from_rpc_error(e, f"prepare on {r.address}"))

        with concurrent.futures.ThreadPoolExecutor(len(results)) as pool:
            list(pool.map(prepare, results))
        decision_key = self._prefix + "decisions/" + frid
        failed = [r for r in results if r.error]
        if failed:
            self._abort(results, decision_key, "prepare failed", stubs)
            raise RefitConflict(f"fleet refit {frid} aborted: " +
                                "; ".join(f"{r.member_id}: {r.error}" for r in failed))
        decision = json.dumps({"decision": "commit", "fleet_version": fleet_version,
                               "members": [r.member_id for r in results], "by": "python",
                               "unix_seconds": time.time()})
        version = {"fleet_version": fleet_version, "fleet_refit_id": frid}
        txn = self._etcd.call("/v3/kv/txn", {
            "compare": [{"key": _b64(decision_key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"},
                        {"key": _b64(self._prefix + "version"), "target": "MOD",
                         "result": "EQUAL", "mod_revision": version_mod}],
            "success": [{"request_put": {"key": _b64(decision_key), "value": _b64(decision)}},
                        {"request_put": {"key": _b64(self._prefix + "version"),
                                         "value": _b64(json.dumps(version))}}]})
        if not txn.get("succeeded"):
            self._abort(results, decision_key, "the fleet decided otherwise first", stubs)
            raise RefitConflict(f"fleet refit {frid} aborted: a decision was recorded first or "
                                "the fleet version moved on")

        def commit(r: FleetMemberResult) -> None:
            try:
                stub = stubs[id(r)]
                c = stub.Commit(pb.CommitRequest(refit_id=r.refit_id), metadata=self._metadata,
                                timeout=30)
                r.committed, r.version, r.fingerprint = True, c.result.version, c.result.fingerprint
                r.commit_seconds = c.result.timings.commit_seconds
                s = stub.GetStatus(pb.GetStatusRequest(), metadata=self._metadata, timeout=30)
                r.commit_unix_seconds = s.last_commit_unix_seconds
            except grpc.RpcError as e:
                r.error = str(from_rpc_error(e, f"commit on {r.address}"))

        with concurrent.futures.ThreadPoolExecutor(len(results)) as pool:
            list(pool.map(commit, results))
        times = [r.commit_unix_seconds for r in results if r.commit_unix_seconds > 0]
        skew = max(times) - min(times) if times else 0.0
        version["flip_skew_seconds"] = skew
        self._etcd.put(self._prefix + "version", json.dumps(version))
        self._delete_old_decisions(members)
        return FleetRefitResult(frid, fleet_version, results, skew)

    def _delete_old_decisions(self, members: List[Dict[str, Any]]) -> int:
        """After a commit (the fleet's version moved, so no older refit can
        still record commit): deletes decisions beyond the newest
        keep_decisions that are older than every member's prepared timeout
        (30 s for a member that does not publish it)."""
        if self._keep_decisions <= 0:
            return 0
        oldest = max([float(m.get("prepared_timeout_seconds") or 30.0) for m in members] + [0.0])
        try:
            kvs = self._etcd.get_prefix(self._prefix + "decisions/")
        except Unavailable:
            return 0  # the next committed refit tries again
        kvs.sort(key=lambda kv: int(kv.get("create_revision", 0)), reverse=True)
        deleted = 0
        now = time.time()
        for kv in kvs[self._keep_decisions:]:
            try:
                written = float(json.loads(_unb64(kv["value"])).get("unix_seconds", 0))
            except (ValueError, AttributeError):
                written = 0.0
            if written > 0 and now - written <= oldest:
                continue
            try:
                deleted += self._etcd.delete(_unb64(kv["key"]))
            except Unavailable:
                break
        return deleted

    def _abort(self, results: List[FleetMemberResult], decision_key: str, why: str,
               stubs: Dict[int, pb_grpc.RefitServiceStub]) -> None:
        try:
            self._etcd.call("/v3/kv/txn", {
                "compare": [{"key": _b64(decision_key), "target": "CREATE", "result": "EQUAL",
                             "create_revision": "0"}],
                "success": [{"request_put": {"key": _b64(decision_key), "value": _b64(
                    json.dumps({"decision": "abort", "by": "python", "why": why,
                                "unix_seconds": time.time()}))}}]})
        except Unavailable:
            pass
        for r in results:
            if r.refit_id:
                try:
                    stubs[id(r)].Abort(pb.AbortRequest(refit_id=r.refit_id, reason=why),
                                       metadata=self._metadata, timeout=10)
                except grpc.RpcError:
                    pass
