mod core;
mod graph;
mod nccl;
mod shared;
