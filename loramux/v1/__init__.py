"""Generated gRPC code of protos/loramux/v1 (tools/gen_protos.py). Do not edit the *_pb2* files."""
