"""What a request and its answer look like: normalisation, chat requests, /v1/responses
conversion and streaming, engine errors.
"""
