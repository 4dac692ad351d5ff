"""engramd kernels: pure tensor functions (gather + dequantize, n-gram hashing), CPU references and GPU versions."""
