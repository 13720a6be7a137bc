"""Layer 1, the format: what one safetensors file is, in torch's terms.

dtypes (torch dtype <-> safetensors dtype names, stored shapes), tensors (live tensors -> tensor sources for the
Rust writer, mapped bytes -> tensors), the pickle-free JSON codec, and JSON input validation.

May import: :mod:`fastckpt._core`, :mod:`fastckpt.errors`, :mod:`fastckpt._version`, and other ``_format`` modules.
"""
