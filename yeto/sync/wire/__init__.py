"""What travels: the adapter's fragment layout, its quantization, and the protocol's messages."""
