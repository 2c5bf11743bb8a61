"""Other engines, met where users run them: exports of mtp's assets to vLLM and llama.cpp, those
engines' environments (built or installed apart from mtp's own), and runners that drive them for
`mtp bench`'s peer rows. Builds on `mtp.core` only."""
