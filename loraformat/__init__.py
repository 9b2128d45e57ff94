"""The adapter format, owned by neither service: PEFT parsing, validation and compilation into the
canonical artifact, the strict safetensors reader/writer, and the architecture specs of the model
families loramux serves. Imports nothing from `registry/` or `engine/`; both import it."""
