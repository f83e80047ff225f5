from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeysRequest(_message.Message):
    __slots__ = ("keys", "failed_verification")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FAILED_VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    failed_verification: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., failed_verification: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length",)
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    def __init__(self, prefix_length: _Optional[int] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("index", "found", "size", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    size: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[GetFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[GetFrame, _Mapping]]] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("key", "size", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[PutFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[PutFrame, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "used_bytes", "capacity_bytes", "blocks", "get_hits", "get_misses", "contains_hits", "contains_misses", "evictions", "errors", "bytes_read", "bytes_written")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GET_HITS_FIELD_NUMBER: _ClassVar[int]
    GET_MISSES_FIELD_NUMBER: _ClassVar[int]
    CONTAINS_HITS_FIELD_NUMBER: _ClassVar[int]
    CONTAINS_MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    get_hits: int
    get_misses: int
    contains_hits: int
    contains_misses: int
    evictions: int
    errors: int
    bytes_read: int
    bytes_written: int
    def __init__(self, name: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., get_hits: _Optional[int] = ..., get_misses: _Optional[int] = ..., contains_hits: _Optional[int] = ..., contains_misses: _Optional[int] = ..., evictions: _Optional[int] = ..., errors: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("name", "requests", "errors", "bytes_in", "bytes_out", "lookup_keys", "lookup_hits", "get_keys", "get_hits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    GET_KEYS_FIELD_NUMBER: _ClassVar[int]
    GET_HITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: int
    errors: int
    bytes_in: int
    bytes_out: int
    lookup_keys: int
    lookup_hits: int
    get_keys: int
    get_hits: int
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., lookup_keys: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., get_keys: _Optional[int] = ..., get_hits: _Optional[int] = ...) -> None: ...

class RecentRates(_message.Message):
    __slots__ = ("window_s", "lookup_hit_rate", "get_hit_rate", "bytes_in_per_s", "bytes_out_per_s", "requests_per_s")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    GET_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    lookup_hit_rate: float
    get_hit_rate: float
    bytes_in_per_s: float
    bytes_out_per_s: float
    requests_per_s: float
    def __init__(self, window_s: _Optional[float] = ..., lookup_hit_rate: _Optional[float] = ..., get_hit_rate: _Optional[float] = ..., bytes_in_per_s: _Optional[float] = ..., bytes_out_per_s: _Optional[float] = ..., requests_per_s: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "lookup_keys", "lookup_hits", "get_keys", "get_hits", "bytes_in", "bytes_out", "requests", "errors", "tiers", "tenants", "recent")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    GET_KEYS_FIELD_NUMBER: _ClassVar[int]
    GET_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    lookup_keys: int
    lookup_hits: int
    get_keys: int
    get_hits: int
    bytes_in: int
    bytes_out: int
    requests: int
    errors: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    recent: RecentRates
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., lookup_keys: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., get_keys: _Optional[int] = ..., get_hits: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., recent: _Optional[_Union[RecentRates, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_block_size", "max_keys_per_call", "chunk_size", "max_message_size")
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_block_size: int
    max_keys_per_call: int
    chunk_size: int
    max_message_size: int
    def __init__(self, max_block_size: _Optional[int] = ..., max_keys_per_call: _Optional[int] = ..., chunk_size: _Optional[int] = ..., max_message_size: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "version", "protocol_version", "limits", "tenant", "role", "data_port", "data_protocol_version")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[HealthResponse.Status]
        SERVING: _ClassVar[HealthResponse.Status]
        DRAINING: _ClassVar[HealthResponse.Status]
    UNKNOWN: HealthResponse.Status
    SERVING: HealthResponse.Status
    DRAINING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    version: str
    protocol_version: int
    limits: Limits
    tenant: str
    role: str
    data_port: int
    data_protocol_version: int
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., tenant: _Optional[str] = ..., role: _Optional[str] = ..., data_port: _Optional[int] = ..., data_protocol_version: _Optional[int] = ...) -> None: ...
