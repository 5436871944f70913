"""Engine adapters: the real vLLM server and the simulator in real time, behind one interface."""
