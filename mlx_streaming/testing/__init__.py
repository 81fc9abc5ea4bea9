"""What the tests, the benchmarks and the demo build: tiny models of every
family, synthetic large ones, real-size sparse ones (headers over holes), and a
local stand-in for the Hugging Face Hub; and (``helpers``) what the tests
share, the one place they take their helpers from."""
