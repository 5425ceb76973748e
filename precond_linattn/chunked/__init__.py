"""Chunked pure-JAX forms: parallel work inside chunks of C tokens, a scan across chunks."""
