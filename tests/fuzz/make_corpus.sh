#!/usr/bin/env bash
# Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): well-formed inputs
# of every kind each target takes, from which the fuzzer mutates. Protobuf seeds are encoded
# from text with protoc. Re-run after a protocol change; the output is committed.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
corpus="$here/corpus"
encode() {  # encode <message> <text> -> stdout
  printf '%s' "$2" | protoc --encode="collserve.v1.$1" -I "$root/proto" \
    "$root/proto/collserve/v1/store.proto" "$root/proto/collserve/v1/registry.proto" \
    "$root/proto/collserve/v1/collectives.proto"
}
rm -rf "$corpus"
mkdir -p "$corpus"/{tcpstore_protocol,wal_replay,collective_request,coordinator_rpc,sidecar_session,ops_channel}

# TCPStore requests, both dialects (tcpstore_protocol.h has the layout).
python3 - "$corpus/tcpstore_protocol" <<'PY'
import struct, sys, os
d = sys.argv[1]
s = lambda b: struct.pack("<Q", len(b)) + b
keys = lambda ks: struct.pack("<Q", len(ks)) + b"".join(s(k) for k in ks)
v2 = b"\x00" + struct.pack("<I", 0x3C85F7CE)
seeds = {
  "v2_session": v2 + b"\x01" + s(b"k") + s(b"v") + b"\x03" + s(b"k") + b"\x04" + s(b"c") + struct.pack("<q", 1)
                + b"\x05" + keys([b"k"]) + b"\x06" + keys([b"k", b"c"]) + b"\x07" + b"\x0d" + b"ping",
  "v2_multi": v2 + b"\x0b" + struct.pack("<q", 2) + s(b"a") + s(b"1") + s(b"b") + s(b"2") + b"\x0a" + keys([b"a", b"b"])
              + b"\x0c" + b"\x08" + s(b"a") + b"\x09" + s(b"b") + s(b"3") + b"\x02" + s(b"a") + s(b"") + s(b"x"),
  "v1_session": b"\x00" + s(b"/k") + s(b"v") + b"\x02" + s(b"/k") + b"\x03" + s(b"/c") + struct.pack("<q", 5)
                + b"\x04" + keys([b"/k"]) + b"\x05" + keys([b"/k"]) + b"\x06" + b"\x07" + s(b"/w") + b"\x08" + s(b"/k"),
  "v1_compare_set": b"\x01" + s(b"/k") + s(b"old") + s(b"new"),
}
for name, data in seeds.items():
    open(os.path.join(d, name), "wb").write(data)
PY

# Write-ahead logs and snapshots (store/wal.h): first byte 0 = log, 1 = snapshot.
python3 - "$corpus/wal_replay" <<'PY'
import struct, sys, os, zlib
d = sys.argv[1]
def varint(n):
    out = b""
    while n >= 0x80:
        out += bytes([(n & 0x7f) | 0x80]); n >>= 7
    return out + bytes([n])
def op(kind, key, value=None):
    b = bytes([kind]) + varint(len(key)) + key
    if kind == 1: b += varint(len(value)) + value
    return b
def record(payload):
    length = struct.pack("<I", len(payload))
    return length + struct.pack("<I", zlib.crc32(length + payload) & 0xffffffff) + payload
log = record(op(1, b"job/a", b"1")) + record(op(1, b"job/b", b"2") + op(2, b"job/a")) + record(op(1, b"job/c", b"x" * 40))
open(os.path.join(d, "log"), "wb").write(b"\x00" + log)
open(os.path.join(d, "log_torn_tail"), "wb").write(b"\x00" + log + record(op(1, b"job/d", b"4"))[:9])
open(os.path.join(d, "snapshot"), "wb").write(b"\x01" + record(op(1, b"job/a", b"1")) + record(op(1, b"job/b", b"2")))
PY

# Collective messages (collectives.proto) against a registered segment named "seg".
encode Collective 'seq: 0 op: ALL_REDUCE dtype: FLOAT32 reduce_op: SUM count: 16 buffer { segment: "seg" segment_bytes: 4096 offset: 64 }' > "$corpus/collective_request/all_reduce_segment"
encode Collective 'seq: 0 op: ALL_REDUCE dtype: INT32 reduce_op: MAX count: 2 buffer { inline_data: "\001\000\000\000\002\000\000\000" }' > "$corpus/collective_request/all_reduce_inline"
encode Collective 'seq: 0 op: ALL_GATHER dtype: FLOAT64 count: 2 output_count: 8 output_splits: [2, 2, 2, 2] buffer { segment: "seg" segment_bytes: 4096 } output { segment: "seg" segment_bytes: 4096 offset: 1024 }' > "$corpus/collective_request/all_gather"
encode Collective 'seq: 0 op: ALL_TO_ALL dtype: UINT8 count: 10 output_count: 6 input_splits: [1, 2, 3, 4] output_splits: [3, 1, 1, 1] buffer { segment: "seg" segment_bytes: 4096 } output { segment: "seg" segment_bytes: 4096 offset: 2048 }' > "$corpus/collective_request/all_to_all"
encode Collective 'seq: 0 op: SEND dtype: BFLOAT16 count: 100 peer: 2 tag: 7 buffer { segment: "seg" segment_bytes: 4096 }' > "$corpus/collective_request/send"
encode Collective 'seq: 0 op: SCATTER dtype: INT64 root: 1 count: 8 output_count: 2 input_splits: [2, 2, 2, 2] buffer { segment: "seg" segment_bytes: 4096 } output { segment: "seg" segment_bytes: 4096 offset: 512 }' > "$corpus/collective_request/scatter"

# Coordinator RPCs: the first byte picks the method (fuzz_coordinator_rpc.cc's kMethods).
rpc() {  # rpc <index> <message> <text> <file>
  { printf "\\x$(printf '%02x' "$1")"; encode "$2" "$3"; } > "$corpus/coordinator_rpc/$4"
}
rpc 0 SetRequest 'job: "j" key: "k" value: "v"' set
rpc 1 GetRequest 'job: "j" key: "k" timeout_ms: -1' get
rpc 2 AddRequest 'job: "j" key: "c" delta: 3' add
rpc 11 JoinRequest 'job: "j" group: "g" world_size: 1 member { rank: 0 host_id: "h" } timeout_ms: 100' join
rpc 11 JoinRequest 'job: "j" group: "g" world_size: 2 member { rank: 1 host_id: "h" } timeout_ms: 100 generation: 3' join_generation
rpc 12 LeaveRequest 'job: "j" group: "g" rank: 0 generation: 2' leave_generation
rpc 13 DescribeRequest 'job: "j" group: "g"' describe
rpc 24 WatchGroupRequest 'job: "j" group: "w" generation: 2 host_id: "h" known: 0 wait_ms: 100 world_size: 2 members { rank: 0 host_id: "h" } members { rank: 1 host_id: "h2" }' watch_adopt
# Sidecar sessions: SessionRequest messages, each behind a 2-byte little-endian length.
session() {  # session <file> <text>...
  local out="$corpus/sidecar_session/$1"
  shift
  : > "$out"
  for text in "$@"; do
    encode SessionRequest "$text" > "$out.msg"
    python3 -c 'import sys,struct; d=open(sys.argv[1],"rb").read(); sys.stdout.buffer.write(struct.pack("<H", len(d)) + d)' "$out.msg" >> "$out"
    rm -f "$out.msg"
  done
}
attach='attach { group: "s" rank: 0 world_size: 1 init_timeout_ms: 1000 op_timeout_ms: 1000 }'
session all_reduce "$attach" 'collective { seq: 0 op: ALL_REDUCE dtype: FLOAT32 reduce_op: SUM count: 2 buffer { inline_data: "\000\000\200?\000\000\000@" } }'
session shared_memory 'attach { group: "s" rank: 0 world_size: 1 shared_memory: true }' 'collective { seq: 0 op: BROADCAST dtype: INT8 root: 0 count: 4 buffer { segment: "memfd-1-0" segment_bytes: 4096 } }'
session barrier_then_bad_seq "$attach" 'collective { seq: 0 op: BARRIER }' 'collective { seq: 5 op: BARRIER }'
session collective_first 'collective { seq: 0 op: ALL_REDUCE dtype: INT32 reduce_op: MAX count: 1 buffer { inline_data: "\001\000\000\000" } }'
session attach_twice "$attach" "$attach"
session attach_generations 'attach { group: "s" rank: 0 world_size: 1 generation: 2 }' 'attach { group: "s" rank: 0 world_size: 1 generation: 3 }'
session read_done 'attach { group: "s" rank: 0 world_size: 1 shared_memory: true peer_reads: true }' 'read_done { seq: 0 }' 'collective { seq: 0 op: BARRIER }' 'read_done { seq: -1 }'
session all_gather "$attach" 'collective { seq: 0 op: ALL_GATHER dtype: UINT8 count: 3 output_count: 3 output_splits: [3] buffer { inline_data: "abc" } }'
# Ops channel: datagrams, each behind a 2-byte little-endian length; a datagram is an 8-byte
# fragment header {magic "CSPO", flags} and a SessionRequest (or a piece of one: flags 1 =
# more fragments follow). A "+" before a request's text cuts it into two fragments.
ops() {  # ops <file> <text>...
  local out="$corpus/ops_channel/$1"
  shift
  : > "$out"
  for text in "$@"; do
    local split=0
    if [ "${text:0:1}" = "+" ]; then split=1; text="${text:1}"; fi
    encode SessionRequest "$text" > "$out.msg"
    python3 -c '
import sys, struct
d = open(sys.argv[1], "rb").read()
parts = [d[:len(d) // 2], d[len(d) // 2:]] if sys.argv[2] == "1" else [d]
for i, p in enumerate(parts):
    g = struct.pack("<II", 0x4F505343, 1 if i + 1 < len(parts) else 0) + p
    sys.stdout.buffer.write(struct.pack("<H", len(g)) + g)' "$out.msg" "$split" >> "$out"
    rm -f "$out.msg"
  done
}
ops all_reduce 'collective { seq: 0 op: ALL_REDUCE dtype: FLOAT32 reduce_op: SUM count: 2 buffer { inline_data: "\000\000\200?\000\000\000@" } }'
ops fragments '+collective { seq: 0 op: ALL_GATHER dtype: UINT8 count: 3 output_count: 3 output_splits: [3] buffer { inline_data: "abc" } }' 'collective { seq: 1 op: BARRIER }'
ops read_done 'collective { seq: 0 op: BARRIER }' 'read_done { seq: 0 }' 'read_done { seq: -1 }'
ops segment 'collective { seq: 0 op: BROADCAST dtype: INT8 root: 0 count: 4 buffer { segment: "memfd-1-0" segment_bytes: 4096 } }'
ops attach 'attach { group: "s" rank: 0 world_size: 1 }'
echo "seed corpora written to $corpus"
