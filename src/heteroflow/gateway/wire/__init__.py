"""Bytes on the wire: HTTP framing and conventions, the RESP client, OpenAI-shaped errors."""
