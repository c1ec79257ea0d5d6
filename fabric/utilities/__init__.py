"""Fabric internals shared by every layer: registries, parsers, collection helpers."""
