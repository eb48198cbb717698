mod core;
mod graph;
