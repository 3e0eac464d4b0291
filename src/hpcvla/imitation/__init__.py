"""The imitation start that RL post-training begins from: a scripted expert's demonstrations
recorded in the dump layout (recording.py, `hpcvla demos`) and supervised fine-tuning on
demonstrations (sft.py, `hpcvla sft`). The readers of demonstration files are demonstrations/,
on floor 3, below preflight.py, which checks the files before launch."""
