#!/usr/bin/env python3
"""Copies etcd's published v3 API .proto files (Debian's golang-etcd-server-dev, etcd 3.4)
into proto/etcd/, ready for protoc's C++ and gRPC generators: the gogoproto and
google.api (grpc-gateway) imports and options, which only the Go and HTTP gateways use, are
removed, and the imports are rewritten to proto/etcd/'s layout. Messages, fields, services
and comments are kept as published. Re-run after an etcd upgrade:

    apt-get install golang-etcd-server-dev && python3 scripts/vendor_etcd_protos.py
"""
import os
import re
import sys

SRC = "/usr/share/gocode/src/go.etcd.io/etcd"
FILES = {  # source (under SRC) -> destination (under proto/)
    "etcdserver/etcdserverpb/rpc.proto": "etcd/etcdserverpb/rpc.proto",
    "mvcc/mvccpb/kv.proto": "etcd/mvccpb/kv.proto",
    "auth/authpb/auth.proto": "etcd/authpb/auth.proto",
}
IMPORTS = {
    "etcd/mvcc/mvccpb/kv.proto": "etcd/mvccpb/kv.proto",
    "etcd/auth/authpb/auth.proto": "etcd/authpb/auth.proto",
}


def strip(text):
    text = re.sub(r'^import "(gogoproto/gogo|google/api/annotations)\.proto";\n', "", text, flags=re.M)
    text = re.sub(r"^option \(gogoproto\.[a-z_]+\) = [a-z]+;\n", "", text, flags=re.M)
    # rpc X(A) returns (B) { option (google.api.http) = { ... }; }  ->  rpc X(A) returns (B) {}
    # (the option's body may hold one level of braces: additional_bindings { ... })
    text = re.sub(r"\{\s*option \(google\.api\.http\) = \{(?:[^{}]|\{[^{}]*\})*\};\s*\}", "{}", text)
    for old, new in IMPORTS.items():
        text = text.replace(f'import "{old}";', f'import "{new}";')
    if "gogoproto" in text or "google.api" in text:
        raise SystemExit("a gogoproto or google.api use is left: update this script")
    return text


def main():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "proto")
    for src, dst in FILES.items():
        with open(os.path.join(SRC, src)) as f:
            text = strip(f.read())
        header = (f"// Vendored from etcd v3.4's {src} (Debian's golang-etcd-server-dev; Apache License 2.0)\n"
                  f"// by scripts/vendor_etcd_protos.py: gogoproto and google.api options removed.\n")
        path = os.path.join(root, dst)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(header + text)
        print(f"{src} -> proto/{dst}", file=sys.stderr)


if __name__ == "__main__":
    main()
