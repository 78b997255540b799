from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("incarnation", "step", "channel", "src", "tensors", "total_bytes", "little_endian", "metadata")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LITTLE_ENDIAN_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    step: int
    channel: str
    src: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    little_endian: bool
    metadata: bytes
    def __init__(self, incarnation: _Optional[int] = ..., step: _Optional[int] = ..., channel: _Optional[str] = ..., src: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., little_endian: _Optional[bool] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("envelope", "data")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    data: bytes
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeliverReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("label",)
    LABEL_FIELD_NUMBER: _ClassVar[int]
    label: str
    def __init__(self, label: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("role", "rank", "address", "host", "pid")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    role: str
    rank: int
    address: str
    host: str
    pid: int
    def __init__(self, role: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("rank", "incarnation", "num_workers", "num_servers", "heartbeat_interval_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    incarnation: int
    num_workers: int
    num_servers: int
    heartbeat_interval_s: float
    def __init__(self, rank: _Optional[int] = ..., incarnation: _Optional[int] = ..., num_workers: _Optional[int] = ..., num_servers: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("label", "address", "host", "pid")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    label: str
    address: str
    host: str
    pid: int
    def __init__(self, label: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class WaitForPeersRequest(_message.Message):
    __slots__ = ("label", "timeout_s")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    label: str
    timeout_s: float
    def __init__(self, label: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PeerTable(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class SubmitPlanRequest(_message.Message):
    __slots__ = ("label", "fingerprint", "summary")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    label: str
    fingerprint: str
    summary: str
    def __init__(self, label: _Optional[str] = ..., fingerprint: _Optional[str] = ..., summary: _Optional[str] = ...) -> None: ...

class SubmitPlanReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("state", "reason", "failed_label", "num_steps")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RUNNING: _ClassVar[JobStatus.State]
        FAILED: _ClassVar[JobStatus.State]
        FINISHED: _ClassVar[JobStatus.State]
    RUNNING: JobStatus.State
    FAILED: JobStatus.State
    FINISHED: JobStatus.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_LABEL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    state: JobStatus.State
    reason: str
    failed_label: str
    num_steps: int
    def __init__(self, state: _Optional[_Union[JobStatus.State, str]] = ..., reason: _Optional[str] = ..., failed_label: _Optional[str] = ..., num_steps: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("label", "step", "waiting_on", "waiting_s", "rss_bytes", "peak_rss_bytes", "memory_limit_bytes")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_ON_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    label: str
    step: int
    waiting_on: str
    waiting_s: float
    rss_bytes: int
    peak_rss_bytes: int
    memory_limit_bytes: int
    def __init__(self, label: _Optional[str] = ..., step: _Optional[int] = ..., waiting_on: _Optional[str] = ..., waiting_s: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("label", "message", "dead_peer")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DEAD_PEER_FIELD_NUMBER: _ClassVar[int]
    label: str
    message: str
    dead_peer: str
    def __init__(self, label: _Optional[str] = ..., message: _Optional[str] = ..., dead_peer: _Optional[str] = ...) -> None: ...

class FinishedReport(_message.Message):
    __slots__ = ("label", "num_steps")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    label: str
    num_steps: int
    def __init__(self, label: _Optional[str] = ..., num_steps: _Optional[int] = ...) -> None: ...

class DoneReport(_message.Message):
    __slots__ = ("label",)
    LABEL_FIELD_NUMBER: _ClassVar[int]
    label: str
    def __init__(self, label: _Optional[str] = ...) -> None: ...

class DoneReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvPutRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvPutReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("key", "timeout_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_s: float
    def __init__(self, key: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class KvGetReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("name", "label", "timeout_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    label: str
    timeout_s: float
    def __init__(self, name: _Optional[str] = ..., label: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class BarrierReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
