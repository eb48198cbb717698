mod core;
mod tools;
