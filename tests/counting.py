"""A model that writes a buffer in place in forward (``seen`` counts the samples it saw): the
case the runtime must run uncaptured and name, and must write exactly once per step."""
import torch


class Counting(torch.nn.Module):
    def __init__(self, features: int = 4, classes: int = 3):
        super().__init__()
        self.lin = torch.nn.Linear(features, classes)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.shape[0])
        return self.lin(x)
