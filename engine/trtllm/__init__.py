"""TensorRT-LLM adapter (optional extra): `backend.TrtllmBackend` behind the `Backend` protocol.

Importing this package never imports `tensorrt_llm`; only `TrtllmBackend.start()` does.
"""
