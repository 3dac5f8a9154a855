"""What travels and how it is coded: the adapter's fragment layout, its quantization (numpy loops threaded over spans),
and the protocol's messages."""
