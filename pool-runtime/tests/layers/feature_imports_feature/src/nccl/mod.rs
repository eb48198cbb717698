// Declared: NCCL collectives are recorded in graphs.
use crate::graph::Graph;
