"""The pack stage: inputs checked up front, then a streamed read - quantize - write pipeline."""
