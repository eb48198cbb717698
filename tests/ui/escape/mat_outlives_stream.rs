use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, Stream};

fn main() {
    let buf = {
        let stream = Stream::new(&Device::host()).unwrap();
        BufferPool::new(&stream).get_buffer_1d::<u8>(8).unwrap()
    };
    println!("{}", buf.len());
}
