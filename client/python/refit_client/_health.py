"""grpc.health.v1 over generic stubs, encoded by hand.

The two messages have one field each, so the client encodes them itself
instead of registering grpc.health.v1 in the process's protobuf descriptor
pool, where it would clash with grpcio-health-checking's copy.
"""

from __future__ import annotations

CHECK_METHOD = "/grpc.health.v1.Health/Check"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
READINESS_SERVICE = "refit.v1.RefitService"
LIVENESS_SERVICE = ""

_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_request(service: str) -> bytes:
    """HealthCheckRequest{service = 1}."""
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_response(data: bytes) -> str:
    """HealthCheckResponse{status = 1} -> "SERVING", "NOT_SERVING", ..."""
    status = 0
    i = 0
    while i < len(data):
        key = data[i]
        i += 1
        wire = key & 7
        value = 0
        if wire == 0:
            shift = 0
            while True:
                byte = data[i]
                i += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            if key >> 3 == 1:
                status = value
        elif wire == 2:  # unknown length-delimited field: skip it
            length, shift = 0, 0
            while True:
                byte = data[i]
                i += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            i += length
        else:
            break
    return _STATUS_NAMES.get(status, "UNKNOWN")
