"""The base every layer stands on: config, errors, events, the SGLang facts, the host spec, parsers."""
